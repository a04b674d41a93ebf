#include "common/peer_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

namespace modelavg {

std::string PeerAddress(const sockaddr* addr) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (addr == nullptr) return "?";
  if (addr->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, text, sizeof(text));
  } else if (addr->sa_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &a, text, sizeof(text));
    }
  } else {
    return "?";
  }
  return text;
}

}  // namespace modelavg
