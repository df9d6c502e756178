#!/usr/bin/python3
"""Writes the expected renders of the chat templates in this folder (test data for test_chat_template.cpp).

Run with Debian's jinja2 (apt-get install python3-jinja2), from this folder:  /usr/bin/python3 make_expected.py

Every family of cases.json is rendered (its template is FAMILY.jinja, or, with "template_from", the
chat_template of that tokenizer_config.json under the reference data, ../shared/refdata or
$SPECMESH_REFDATA) with every case of cases.json, in the environment Hugging Face
transformers renders chat templates with (render_jinja_template / _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension, its own tojson filter (json.dumps with ensure_ascii=False, no key sorting), and the
raise_exception and strftime_now globals. The variables are the family's special tokens, tools=None
unless the case gives tools, and the case's own (messages, add_generation_prompt, ...).
A render goes to FAMILY.CASE.txt; a template that raises writes its message to FAMILY.CASE.error.txt.
The small one-feature templates of features.json are rendered in the same environment into
features.expected.json, in the same order.
"""
import glob
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class GenerationBlock(jinja2.ext.Extension):
    """Hugging Face's AssistantTracker as far as rendering goes: {% generation %} renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def refdata_dir(here):
    return os.environ.get("SPECMESH_REFDATA") or os.path.join(here, "..", "..", "..", "..", "shared", "refdata")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "cases.json"), encoding="utf-8") as f:
        spec = json.load(f)
    for old in glob.glob(os.path.join(here, "*.txt")):
        os.remove(old)
    env = environment()
    for family, tokens in spec["families"].items():
        tokens = dict(tokens)
        source = tokens.pop("template_from", None)
        if source:  # a tokenizer_config.json of the reference data, not kept in this repository
            with open(os.path.join(refdata_dir(here), source), encoding="utf-8") as f:
                template = env.from_string(json.load(f)["chat_template"])
        else:
            with open(os.path.join(here, family + ".jinja"), encoding="utf-8", newline="") as f:
                template = env.from_string(f.read())
        for case, variables in spec["cases"].items():
            context = {"tools": None, **tokens, **variables}
            try:
                name, text = f"{family}.{case}.txt", template.render(**context)
            except jinja2.exceptions.TemplateError as e:
                name, text = f"{family}.{case}.error.txt", str(e)
            with open(os.path.join(here, name), "w", encoding="utf-8", newline="") as f:
                f.write(text)
            print(name)
    with open(os.path.join(here, "features.json"), encoding="utf-8") as f:
        features = json.load(f)
    env.add_extension(GenerationBlock)
    renders = [env.from_string(f["template"]).render(**f.get("context", {})) for f in features]
    with open(os.path.join(here, "features.expected.json"), "w", encoding="utf-8", newline="") as f:
        json.dump(renders, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("features.expected.json")


if __name__ == "__main__":
    main()
