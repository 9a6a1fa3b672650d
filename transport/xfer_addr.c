/* xfer_addr.c: where the transfer plane listens: whether an address means "every interface" and
 * which network interface holds an address (UCX's tcp transport and NCCL choose interfaces, not
 * addresses, and bind the interface's address). Sockets themselves are the backends'. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "transport/xfer_impl.h"

bool kvf_xfer_host_is_any(const char *host)
{
    return !host || !*host || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0 ||
           strcmp(host, "[::]") == 0;
}

kvf_status kvf_xfer_host_ifname(const char *host, char *ifname, size_t cap, kvf_err *err)
{
    struct in_addr a4;
    struct in6_addr a6;
    int fam = inet_pton(AF_INET, host, &a4) == 1 ? AF_INET
            : inet_pton(AF_INET6, host, &a6) == 1 ? AF_INET6 : 0;
    if (!fam)
        return kvf_err_set(err, KVF_ERR_INVALID, "xfer: listen address '%s' is not a numeric IPv4 "
                           "or IPv6 address", host);
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return kvf_err_set(err, KVF_ERR_IO, "xfer: listing network interfaces: %s", strerror(errno));
    const char *found = NULL;
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != fam)
            continue;
        if (fam == AF_INET &&
            ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == a4.s_addr)
            found = i->ifa_name;
        if (fam == AF_INET6 &&
            memcmp(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, &a6, sizeof a6) == 0)
            found = i->ifa_name;
    }
    kvf_status st = KVF_OK;
    if (!found || strlen(found) >= cap)
        st = kvf_err_set(err, KVF_ERR_INVALID, "xfer: no network interface has the address %s "
                         "(give one of this node's addresses, or 0.0.0.0 for every interface)",
                         host);
    else
        snprintf(ifname, cap, "%s", found);
    freeifaddrs(ifs);
    return st;
}
