/*
 * dacp RPC accept filter: loaded into ggml-rpc-server with LD_PRELOAD, it lets the worker
 * accept only connections from the addresses listed in the file named by
 * $DACP_RPC_ALLOWED_PEERS (one IP address per line, written by the agent, re-read at every
 * connection). Every other connection is closed as soon as it is accepted, before the worker
 * reads a byte of it, and logged to stderr. Without the variable, or when the file cannot be
 * read, nobody is let in (fail closed).
 *
 * ggml-rpc-server has no authentication, so this is what keeps a worker to its job's primary.
 * It sits in accept() only: accepted connections are the worker's own sockets, so the RPC
 * traffic (one round trip per token in split decode) pays nothing for it.
 *
 * Built by `python -m ops.build_llama` next to the llama.cpp binaries; the agent
 * (agent/runtime/rpc_filter.py) checks that it is mapped into the worker before reporting it ready.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define ALLOWED_ENV "DACP_RPC_ALLOWED_PEERS"

typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);

/* The peer's address as text; an IPv4-mapped IPv6 address as plain IPv4. 0 on success. */
static int peer_text(int fd, char *out, size_t size) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0) {
        return -1;
    }
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
        return inet_ntop(AF_INET, &v4->sin_addr, out, size) ? 0 : -1;
    }
    if (ss.ss_family == AF_INET6) {
        struct in6_addr *v6 = &((struct sockaddr_in6 *)&ss)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(v6)) {
            return inet_ntop(AF_INET, &v6->s6_addr[12], out, size) ? 0 : -1;
        }
        return inet_ntop(AF_INET6, v6, out, size) ? 0 : -1;
    }
    return -1;
}

/* Whether `peer` is a line of the allowed-peers file. */
static int peer_allowed(const char *peer) {
    const char *path = getenv(ALLOWED_ENV);
    if (path == NULL || *path == '\0') {
        return 0;
    }
    FILE *file = fopen(path, "re");
    if (file == NULL) {
        return 0;
    }
    char line[128];
    int allowed = 0;
    while (!allowed && fgets(line, sizeof line, file) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        allowed = line[0] != '\0' && strcmp(line, peer) == 0;
    }
    fclose(file);
    return allowed;
}

/* 1 to hand `fd` to the worker; 0 after closing it. */
static int admit(int fd) {
    char peer[INET6_ADDRSTRLEN] = "";
    if (peer_text(fd, peer, sizeof peer) == 0 && peer_allowed(peer)) {
        return 1;
    }
    int saved = errno;
    fprintf(stderr, "dacp-rpc-filter: refused a connection from %s\n", peer[0] ? peer : "?");
    fflush(stderr);
    close(fd);
    errno = saved;
    return 0;
}

int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    static accept_fn real_accept;
    if (real_accept == NULL) {
        real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    }
    socklen_t capacity = len != NULL ? *len : 0;
    for (;;) {
        if (len != NULL) {
            *len = capacity;
        }
        int client = real_accept(fd, addr, len);
        if (client < 0 || admit(client)) {
            return client;
        }
    }
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static accept4_fn real_accept4;
    if (real_accept4 == NULL) {
        real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
    }
    socklen_t capacity = len != NULL ? *len : 0;
    for (;;) {
        if (len != NULL) {
            *len = capacity;
        }
        int client = real_accept4(fd, addr, len, flags);
        if (client < 0 || admit(client)) {
            return client;
        }
    }
}
