#include "specmesh/cli/interrupt.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace specmesh {

Interrupts::Interrupts() {
  sigemptyset(&set_);
  sigaddset(&set_, SIGINT);
  sigaddset(&set_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set_, &old_);
  thread_ = std::thread([this] { loop(); });
}

Interrupts::~Interrupts() {
  stop_ = true;
  thread_.join();
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
}

void Interrupts::watch(Generation* generation) {
  std::lock_guard<std::mutex> lk(mu_);
  generation_ = generation;
  if (generation) received_ = 0;
}

void Interrupts::loop() {
  const timespec tick{0, 100 * 1000 * 1000};
  while (!stop_) {
    const int sig = sigtimedwait(&set_, nullptr, &tick);
    if (sig <= 0) continue;
    std::lock_guard<std::mutex> lk(mu_);
    if (generation_ && received_ == 0) {
      received_ = sig;
      generation_->cancel();
      continue;
    }
    const std::string msg = std::string("\nspecmesh: ") + strsignal(sig) + ": stopped\n";
    (void)!::write(2, msg.data(), msg.size());
    std::_Exit(128 + sig);  // started nodes end with this process (their parent-death signal)
  }
}

}  // namespace specmesh
