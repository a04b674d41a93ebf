// One HTTP/1.0 GET to 127.0.0.1, for tests of the coordinator's HTTP port.
#ifndef MODELAVG_TESTS_TOOLS_HTTP_GET_H_
#define MODELAVG_TESTS_TOOLS_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace modelavg::testing {

// The whole reply, or "" when the connection failed; reading stops after `timeout_s` of silence.
// `headers` are extra header lines, each ending in "\r\n".
inline std::string HttpGet(int port, const std::string& path, const std::string& headers = "",
                           int timeout_s = 5) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n", headers, "\r\n");
  (void)!write(fd, request.data(), request.size());
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) reply.append(buf, n);
  close(fd);
  return reply;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_HTTP_GET_H_
