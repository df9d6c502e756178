// CURVE key pairs as ZeroMQ writes them: Z85 text, 40 characters for 32 bytes. Everything here
// wraps libzmq (zmq_curve_keypair, zmq_curve_public, zmq_z85_decode); nothing is hand-rolled.
#pragma once

#include <string>

namespace specmesh {

struct CurveKeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters
};

// Whether this libzmq was built with CURVE (libsodium or tweetnacl).
bool curve_supported();

// A fresh key pair from libzmq's random source. Throws std::runtime_error without CURVE.
CurveKeyPair curve_keypair();

// True for 40 characters of Z85 that decode to a 32-byte key.
bool is_z85_key(const std::string& z85);

// The 32 raw bytes of a Z85 key; throws std::invalid_argument for anything else.
std::string z85_key_bytes(const std::string& z85);

// The public key that belongs to a Z85 secret key; throws std::invalid_argument.
std::string curve_public_of(const std::string& secret_z85);

}  // namespace specmesh
