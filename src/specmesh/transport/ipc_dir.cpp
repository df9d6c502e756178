#include "specmesh/transport/ipc_dir.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace specmesh::gw {

namespace {

std::string octal(mode_t m) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%04o", unsigned(m & 07777));
  return buf;
}

[[noreturn]] void refuse(const std::string& dir, const std::string& what) {
  throw std::runtime_error("ipc directory '" + dir + "' " + what +
                           ": ipc socket files must be in a directory that only this user can use (mode 0700, "
                           "owned by uid " + std::to_string(::geteuid()) +
                           "); name a path in such a directory, or in a missing one, which is then created 0700");
}

// Creates the missing directories of `dir`, each 0700 (chmod-ed, so the umask cannot widen it).
void create_private(const std::filesystem::path& dir) {
  if (dir.empty()) return;
  struct stat st {};
  if (::lstat(dir.c_str(), &st) == 0) return;
  if (errno != ENOENT) return;  // reported by the check below
  create_private(dir.parent_path());
  if (::mkdir(dir.c_str(), 0700) == 0) {
    ::chmod(dir.c_str(), 0700);
  } else if (errno != EEXIST) {  // EEXIST: made by someone else meanwhile, checked below
    throw std::runtime_error("cannot create ipc directory '" + dir.string() + "': " + std::strerror(errno));
  }
}

}  // namespace

void ensure_private_ipc_dir(const std::string& path) {
  if (path.empty() || path[0] == '@')
    throw std::runtime_error("ipc endpoint 'ipc://" + path +
                             "': abstract sockets (ipc://@NAME) are open to every user of the host; name a file in a "
                             "private directory");
  namespace fs = std::filesystem;
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  create_private(dir);
  const std::string d = dir.string();
  struct stat st {};
  if (::lstat(d.c_str(), &st) != 0) refuse(d, std::string("cannot be read: ") + std::strerror(errno));
  // A symbolic link someone else planted could point anywhere.
  if (S_ISLNK(st.st_mode) && st.st_uid != ::geteuid())
    refuse(d, "is a symbolic link owned by uid " + std::to_string(st.st_uid));
  if (::stat(d.c_str(), &st) != 0) refuse(d, std::string("cannot be read: ") + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) refuse(d, "is not a directory");
  if (st.st_uid != ::geteuid()) refuse(d, "is owned by uid " + std::to_string(st.st_uid));
  if (st.st_mode & 077) refuse(d, "is accessible by group or others (mode " + octal(st.st_mode) + ")");
}

void make_ipc_file_private(const std::string& path) {
  if (::chmod(path.c_str(), 0600) != 0)
    throw std::runtime_error("cannot make ipc socket file '" + path + "' private (chmod 600): " + std::strerror(errno));
}

}  // namespace specmesh::gw
