// A connection's client as the coordinator's ports count it: its address without the port.
#ifndef MODELAVG_COMMON_PEER_ADDRESS_H_
#define MODELAVG_COMMON_PEER_ADDRESS_H_

#include <sys/socket.h>

#include <string>

namespace modelavg {

// The address of `addr` (IPv4 or IPv6) as text, without its port; an IPv4 client seen through
// an IPv6 socket (::ffff:a.b.c.d) as IPv4, so that it is one client whichever way it came. "?"
// for anything else (or null).
std::string PeerAddress(const sockaddr* addr);

}  // namespace modelavg

#endif  // MODELAVG_COMMON_PEER_ADDRESS_H_
