// specmesh-chat on a terminal (a pseudo-terminal, as a person types into it): Ctrl-C stops the
// reply being written and the chat goes on; /stats, /strategy and /reset answer; Ctrl-C at the
// prompt ends the program.
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>

#include "private_dir.hpp"
#include "processes.hpp"
#include "refdata.hpp"

namespace specmesh::test {
namespace {

// A program on the controlling side of a pseudo-terminal.
class Terminal {
 public:
  explicit Terminal(const std::vector<std::string>& argv) {
    std::vector<std::string> copy = argv;
    std::vector<char*> args;
    for (std::string& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    winsize ws{40, 200, 0, 0};
    pid_ = ::forkpty(&fd_, nullptr, nullptr, &ws);
    if (pid_ == 0) {
      ::execv(args[0], args.data());
      ::_exit(127);
    }
  }
  ~Terminal() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  void type(const std::string& keys) { ASSERT_EQ(::write(fd_, keys.data(), keys.size()), ssize_t(keys.size())); }
  // Reads until the screen so far (since the last mark()) holds `text`; false after `timeout`.
  bool wait_for(const std::string& text, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (screen_.find(text, mark_) == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, int(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fd_, buf, sizeof buf);
      if (n <= 0) return screen_.find(text, mark_) != std::string::npos;  // the program ended
      screen_.append(buf, size_t(n));
    }
    return true;
  }
  // Later waits look only at what comes after this point.
  void mark() { mark_ = screen_.size(); }
  std::string since_mark() const { return screen_.substr(mark_); }
  const std::string& screen() const { return screen_; }
  std::optional<int> exit_status(std::chrono::milliseconds timeout) {
    auto st = wait_exit(pid_, timeout);
    exited_ = st.has_value();
    return st;
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string screen_;
  size_t mark_ = 0;
  bool exited_ = false;
};

TEST(ChatTerminal, CtrlCStopsTheReplyNotTheChat) {
  SPECMESH_REQUIRE_REFDATA();
  ScopedTempDir dir("chat-terminal");
  // stories260K with a draft, its target paced at 3 ms a layer (about 65 tokens/s), so a reply
  // of 400 tokens lasts long enough to be interrupted.
  const std::string topo = dir.path + "/chat.toml";
  std::ofstream(topo) << "[run]\nmodel = \"stories\"\ndraft = \"small\"\nstrategy = \"ar\"\n\n"
                      << "[models.stories]\npath = \"" << refdata("gguf-models/stories260K.gguf") << "\"\n\n"
                      << "[models.small]\npath = \"" << refdata("gguf-models/stories260K-draft-small.gguf") << "\"\n\n"
                      << "[nodes.local]\nendpoint = \"inproc://chat-terminal\"\nhead = true\n\n"
                      << "[devices.cpu]\nnode = \"local\"\nprofile = { layer_ms = 3 }\n\n"
                      << "[devices.dcpu]\nnode = \"local\"\n\n"
                      << "[[stages]]\nmodel = \"stories\"\ndevice = \"cpu\"\nfraction = 1.0\n\n"
                      << "[[stages]]\nmodel = \"small\"\ndevice = \"dcpu\"\nfraction = 1.0\n";
  Terminal t({SPECMESH_CHAT_PATH, "-c", topo, "-n", "400", "--temp", "0", "--ignore-eos", "--log-level", "warn"});
  ASSERT_TRUE(t.wait_for("> ")) << t.screen();

  // A long reply, stopped by Ctrl-C after its first words.
  t.mark();
  t.type("Once upon a time\r");
  ASSERT_TRUE(t.wait_for("Once upon a time\r\n")) << t.screen();  // the terminal's echo
  t.mark();
  ASSERT_TRUE(t.wait_for(" the ")) << t.screen();
  t.type("\x03");
  ASSERT_TRUE(t.wait_for("[stopped]", std::chrono::seconds(5))) << t.screen();
  ASSERT_TRUE(t.wait_for("> ")) << t.screen();

  // The program is still there: /stats tells of the stopped reply.
  t.mark();
  t.type("/stats\r");
  ASSERT_TRUE(t.wait_for("tokens/s")) << t.screen();
  ASSERT_TRUE(t.wait_for("> ")) << t.screen();
  const std::string stats = t.since_mark();
  EXPECT_NE(stats.find("strategy ar"), std::string::npos) << stats;
  const size_t at = stats.find(" generated");
  ASSERT_NE(at, std::string::npos) << stats;
  const int generated = std::stoi(stats.substr(stats.rfind(' ', at - 1) + 1));
  EXPECT_GT(generated, 0) << stats;
  EXPECT_LT(generated, 400) << "the reply was not stopped: " << stats;

  // Another strategy for the next reply, and its acceptance in /stats.
  t.mark();
  t.type("/strategy warp\r");
  ASSERT_TRUE(t.wait_for("unknown strategy 'warp'")) << t.screen();
  t.mark();
  t.type("/strategy spec\r");
  ASSERT_TRUE(t.wait_for("(strategy spec from the next reply on)")) << t.screen();
  t.mark();
  t.type("/reset\r");
  ASSERT_TRUE(t.wait_for("(conversation cleared)")) << t.screen();
  t.mark();
  t.type("The dog\r");
  ASSERT_TRUE(t.wait_for("The dog\r\n")) << t.screen();
  t.mark();
  ASSERT_TRUE(t.wait_for(" the ")) << t.screen();
  t.type("\x03");
  ASSERT_TRUE(t.wait_for("[stopped]", std::chrono::seconds(5))) << t.screen();
  t.mark();
  t.type("/stats\r");
  ASSERT_TRUE(t.wait_for("tokens per verification")) << t.screen();
  EXPECT_NE(t.since_mark().find("strategy spec"), std::string::npos) << t.since_mark();
  EXPECT_NE(t.since_mark().find("acceptance"), std::string::npos) << t.since_mark();

  // Ctrl-C at the prompt ends the program, as a signal does.
  ASSERT_TRUE(t.wait_for("> ")) << t.screen();
  t.type("\x03");
  EXPECT_EQ(t.exit_status(std::chrono::seconds(10)), 128 + SIGINT) << t.screen();
}

TEST(ChatTerminal, LogLevelIsCheckedAndSpecmeshLogIsRead) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string chat = SPECMESH_CHAT_PATH;
  const std::string model = refdata("gguf-models/stories260K.gguf");
  auto bad = shell(chat + " -m " + model + " --log-level loud </dev/null 2>&1");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--log-level"), std::string::npos) << bad.out;
  // At debug level the runtime tells what it loads; at the default level it says nothing.
  auto quiet = shell("printf 'Once\\n' | " + chat + " -m " + model + " -n 4 --temp 0 2>&1 >/dev/null");
  EXPECT_EQ(quiet.status, 0) << quiet.out;
  EXPECT_TRUE(quiet.out.empty()) << quiet.out;
  auto loud = shell("printf 'Once\\n' | SPECMESH_LOG=debug " + chat + " -m " + model + " -n 4 --temp 0 2>&1 >/dev/null");
  EXPECT_EQ(loud.status, 0) << loud.out;
  EXPECT_FALSE(loud.out.empty());
  auto flag = shell("printf 'Once\\n' | SPECMESH_LOG=off " + chat + " -m " + model + " -n 4 --temp 0 --log-level debug 2>&1 >/dev/null");
  EXPECT_FALSE(flag.out.empty()) << "--log-level did not win over SPECMESH_LOG";
}

}  // namespace
}  // namespace specmesh::test
