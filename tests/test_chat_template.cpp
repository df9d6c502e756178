// chat/jinja: the chat-template interpreter against jinja2's own renders (made by
// tests/data/chat-templates/make_expected.py with Debian's python3-jinja2 in Hugging Face's
// environment), its errors, and its bounds.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "template_data.hpp"
#include "refdata.hpp"
#include "specmesh/chat/jinja.hpp"

using namespace specmesh;
using nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

const fs::path kData = test::kTemplateData;
using test::slurp;


ordered_json cases() { return ordered_json::parse(slurp(kData / "cases.json")); }

std::string render(std::string_view tmpl, const ordered_json& ctx = ordered_json::object()) {
  return jinja::Template(tmpl).render(ctx);
}

}  // namespace

// Every family's template with every case equals jinja2's render, or raises the same message.
TEST(ChatTemplate, EveryFamilyMatchesTheReferenceRenders) {
  SPECMESH_REQUIRE_REFDATA();
  const ordered_json spec = cases();
  int renders = 0, raises = 0;
  for (const auto& [family, tokens] : spec["families"].items()) {
    // Qwen3's template is read from the reference data's tokenizer_config.json, not kept here.
    const std::string source = tokens.contains("template_from")
                                   ? ordered_json::parse(slurp(test::refdata(tokens["template_from"])))["chat_template"].get<std::string>()
                                   : slurp(kData / (family + ".jinja"));
    const jinja::Template tmpl(source);
    for (const auto& [name, variables] : spec["cases"].items()) {
      ordered_json ctx = {{"tools", nullptr}};
      for (const auto& [k, v] : tokens.items())
        if (k != "template_from") ctx[k] = v;
      for (const auto& [k, v] : variables.items()) ctx[k] = v;
      const fs::path ok = kData / (family + "." + name + ".txt");
      const fs::path raised = kData / (family + "." + name + ".error.txt");
      SCOPED_TRACE(family + "." + name);
      if (fs::exists(ok)) {
        EXPECT_EQ(tmpl.render(ctx), slurp(ok));
        ++renders;
      } else {
        ASSERT_TRUE(fs::exists(raised)) << "no expected render";
        try {
          const std::string text = tmpl.render(ctx);
          ADD_FAILURE() << "rendered instead of raising:\n" << text;
        } catch (const jinja::Raised& e) {
          EXPECT_EQ(e.what(), slurp(raised));
        }
        ++raises;
      }
    }
  }
  EXPECT_EQ(renders + raises, 9 * 7);
  EXPECT_GE(raises, 6);  // Llama 2, Mistral and Gemma refuse some conversations
}

// Small templates for one feature each, rendered by jinja2 into features.expected.json.
TEST(ChatTemplate, FeaturesMatchTheReferenceRenders) {
  const ordered_json features = ordered_json::parse(slurp(kData / "features.json"));
  const ordered_json expected = ordered_json::parse(slurp(kData / "features.expected.json"));
  ASSERT_EQ(features.size(), expected.size());
  for (size_t k = 0; k < features.size(); ++k) {
    const auto& f = features[k];
    SCOPED_TRACE(f["name"].get<std::string>() + ": " + f["template"].get<std::string>());
    EXPECT_EQ(render(f["template"].get<std::string>(), f.value("context", ordered_json::object())),
              expected[k].get<std::string>());
  }
}

TEST(ChatTemplate, SyntaxErrorsNameLineColumnAndWhatWasExpected) {
  const auto message = [](std::string_view tmpl) {
    try {
      jinja::Template t(tmpl);
    } catch (const jinja::Error& e) {
      return std::string(e.what());
    }
    return std::string("parsed");
  };
  EXPECT_EQ(message("{% for m in messages %}\n  {{ m }}\n"),
            "chat template line 2, column 10: expected 'else' or 'endfor', found the end of the template");
  EXPECT_EQ(message("ok\n{% if x %}a{% endfor %}"),
            "chat template line 2, column 15: expected 'elif' or 'else' or 'endif', found 'endfor'");
  EXPECT_EQ(message("{{ a + }}"), "chat template line 1, column 8: expected an expression, found '}}'");
  EXPECT_EQ(message("{{ a b }}"), "chat template line 1, column 6: expected '}}', found 'b'");
  EXPECT_EQ(message("x\n  {% frobnicate %}"),
            "chat template line 2, column 6: unknown statement 'frobnicate' (supported: if, for, set, macro, break, continue, generation)");
  EXPECT_EQ(message("{{ 'abc }}"), "chat template line 1, column 4: string is never closed");
  EXPECT_EQ(message("{% endif %}"), "chat template line 1, column 4: unexpected 'endif' with no open block it could close");
  EXPECT_EQ(message("{{ x "), "chat template line 1, column 1: tag is never closed with '}}'");
  EXPECT_EQ(message("{% set x = 1 }}"), "chat template line 1, column 14: expected '%}'");
}

TEST(ChatTemplate, RenderErrorsNameWhereAndWhy) {
  try {
    render("line one\n{{ 'a' + 1 }}");
    FAIL() << "rendered";
  } catch (const jinja::Error& e) {
    EXPECT_STREQ(e.what(), "chat template line 2, column 8: unsupported operand type(s) for +: 'str' and 'int'");
  }
  try {
    render("{{ foo.bar }}");
    FAIL() << "rendered";
  } catch (const jinja::Error& e) {
    EXPECT_STREQ(e.what(), "chat template line 1, column 7: 'foo' is undefined");
  }
  try {
    render("{{ messages | frob }}");
    FAIL() << "rendered";
  } catch (const jinja::Error& e) {
    EXPECT_STREQ(e.what(), "chat template line 1, column 13: no filter named 'frob'");
  }
  try {
    render("{% set x = [1] %}{{ x.append(2) }}");
    FAIL() << "rendered";
  } catch (const jinja::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unsafe"), std::string::npos) << e.what();
  }
  // raise_exception's message reaches the caller verbatim, from inside macros and loops too.
  try {
    render("{% macro f(m) %}{% for x in [1] %}{{ raise_exception('bad: ' ~ m) }}{% endfor %}{% endmacro %}{{ f('role') }}");
    FAIL() << "rendered";
  } catch (const jinja::Raised& e) {
    EXPECT_STREQ(e.what(), "bad: role");
  }
}

TEST(ChatTemplate, NothingHangs) {
  const auto fails = [](std::string_view tmpl, std::string_view why) {
    try {
      render(tmpl);
    } catch (const jinja::Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "rendered " << tmpl;
  };
  fails("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "steps");
  fails("{{ range(1000000) | length }}", "range() of more than 100000 numbers");
  fails("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests deeper than 64");
  fails("{% set s = 'x' * 100000 %}{% for a in range(1000) %}{{ s }}{% endfor %}", "larger than 64 MiB");
}
