#include "specmesh/transport/curve.hpp"

#include <zmq.h>

#include <stdexcept>

namespace specmesh {

bool curve_supported() { return zmq_has("curve") != 0; }

CurveKeyPair curve_keypair() {
  char pub[41] = {}, sec[41] = {};
  if (zmq_curve_keypair(pub, sec) != 0)
    throw std::runtime_error(std::string("cannot make a CURVE key pair: ") + zmq_strerror(zmq_errno()) +
                             " (is libzmq built with CURVE?)");
  return {pub, sec};
}

bool is_z85_key(const std::string& z85) {
  if (z85.size() != 40) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, z85.c_str()) != nullptr;
}

std::string z85_key_bytes(const std::string& z85) {
  uint8_t raw[32];
  if (z85.size() != 40 || zmq_z85_decode(raw, z85.c_str()) == nullptr)
    throw std::invalid_argument("not a Z85 CURVE key (40 characters of Z85)");
  return std::string(reinterpret_cast<const char*>(raw), sizeof raw);
}

std::string curve_public_of(const std::string& secret_z85) {
  if (!is_z85_key(secret_z85)) throw std::invalid_argument("not a Z85 CURVE secret key (40 characters of Z85)");
  char pub[41] = {};
  if (zmq_curve_public(pub, secret_z85.c_str()) != 0)
    throw std::invalid_argument(std::string("cannot derive the public key: ") + zmq_strerror(zmq_errno()));
  return pub;
}

}  // namespace specmesh
