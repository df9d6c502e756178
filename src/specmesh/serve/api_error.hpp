// An error answered to an HTTP client in the OpenAI API's shape:
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with its HTTP status.
#pragma once

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace specmesh::serve {

struct ApiError : std::runtime_error {
  int status;        // HTTP status: 400, 401, 404, 413, 429, 500, 503
  std::string type;  // "invalid_request_error", "authentication_error", ...
  std::string code;  // machine-readable: "invalid_value", "context_length_exceeded", ...
  std::string param; // the request field at fault, empty when none is

  ApiError(int status, std::string type, std::string code, const std::string& message, std::string param = {})
      : std::runtime_error(message), status(status), type(std::move(type)), code(std::move(code)),
        param(std::move(param)) {}

  nlohmann::json body() const {
    return {{"error",
             {{"message", what()},
              {"type", type},
              {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
              {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}}}};
  }
};

// A field of the request that is malformed or out of range: 400.
inline ApiError bad_field(const std::string& param, const std::string& message) {
  return ApiError(400, "invalid_request_error", "invalid_value", message, param);
}

}  // namespace specmesh::serve
