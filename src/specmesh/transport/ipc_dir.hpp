// ipc:// sockets that only this user can reach (private to transport/).
//
// A Unix socket file is as private as the directory it is in: connecting needs search
// permission on every directory of its path and write permission on the file. ZeroMQ creates
// the file with bind() under the process's umask, and umask is process-wide (changing it around
// the bind would race with every other thread that creates files), so the file itself is
// chmod-ed to 0600 right after the bind, and the directory is what makes the window between
// the two harmless: it must belong to this user and give group and others no access at all
// (mode 0700 or stricter). A missing directory is created 0700; one that is shared (/tmp
// itself, 0755 folders) or someone else's is refused with an error naming it. Linux abstract
// sockets (ipc://@NAME) have no permissions at all and are refused too.
#pragma once

#include <string>

namespace specmesh::gw {

// For the socket file at `path` (an ipc:// endpoint without the scheme): creates its
// directory 0700 if missing and checks that it is this user's and private. Throws
// std::runtime_error naming the directory and what is wrong.
void ensure_private_ipc_dir(const std::string& path);

// chmod 0600 of a socket file that was just bound; throws std::runtime_error naming it.
void make_ipc_file_private(const std::string& path);

}  // namespace specmesh::gw
