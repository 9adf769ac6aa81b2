/* natsload: a NATS request/reply load generator in C, the measuring instrument of bench/auth.py.

   A Python client on 2 shared cores adds its own event-loop and garbage-collector jitter to every latency it
   measures; this one adds almost none, so what it reports is the server side's. One connection, the plain NATS
   text protocol, one wildcard inbox subscription; request i is published with the reply subject _INBOX.nl.<i>.

   natsload HOST PORT SUBJECT PAYLOAD_FILE closed N CONCURRENCY
   natsload HOST PORT SUBJECT PAYLOAD_FILE open   N RATE_PER_S

   PAYLOAD_FILE holds one payload per line (request i sends line i mod lines). closed: CONCURRENCY requests in
   flight until N are answered. open: request i is due at start + i / RATE whatever the answers do: a slow answer
   never delays a later request (no coordinated omission), so latency runs from the moment the request was written.
   What can delay a send is only this process's own wake-up; client_late_* reports it (due to written), which on a
   quiet machine is the kernel's and the hypervisor's wake-up latency: the floor under every other figure.
   Prints one JSON object: requests, seconds, per_s, p50_ms, p99_ms, max_ms, allowed (replies containing
   "allowed":true), client_late_p99_ms, client_late_max_ms. Exit 1 with a message on stderr on any protocol error
   or when no reply comes for 10 s. */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/prctl.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    fprintf(stderr, "natsload: %s%s%s\n", what, errno ? ": " : "", errno ? strerror(errno) : "");
    exit(1);
}

/* ---- output buffer: everything due is written in one go ---- */
static char *out;
static size_t out_len, out_cap;

static void out_put(const char *p, size_t n) {
    if (out_len + n > out_cap) {
        out_cap = (out_len + n) * 2;
        out = realloc(out, out_cap);
        if (!out) die("out of memory");
    }
    memcpy(out + out_len, p, n);
    out_len += n;
}

static int sock;

static void flush_out(int block) {
    size_t done = 0;
    while (done < out_len) {
        ssize_t w = write(sock, out + done, out_len - done);
        if (w > 0) { done += (size_t)w; continue; }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) {
            if (!block) break;
            struct pollfd p = {sock, POLLOUT, 0};
            poll(&p, 1, 1000);
            continue;
        }
        die("write");
    }
    memmove(out, out + done, out_len - done);
    out_len -= done;
}

/* ---- payloads ---- */
static char **payload;
static size_t *payload_len;
static size_t payloads;

static void load_payloads(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) die("payload file");
    char *line = NULL;
    size_t cap = 0, n = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0) {
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
        if (!len) continue;
        payload = realloc(payload, (n + 1) * sizeof *payload);
        payload_len = realloc(payload_len, (n + 1) * sizeof *payload_len);
        payload[n] = malloc((size_t)len);
        memcpy(payload[n], line, (size_t)len);
        payload_len[n++] = (size_t)len;
    }
    free(line);
    fclose(f);
    if (!n) { errno = 0; die("payload file has no lines"); }
    payloads = n;
}

/* ---- requests ---- */
static const char *subject;
static double *started;   /* when request i was written */
static double *latency;   /* seconds; < 0 while unanswered */
static long sent, answered, allowed;
static double *late;      /* open loop: how long after it was due request i went out (the client's own delay) */

static void send_request(long i, double at) {
    char head[256];
    size_t p = (size_t)(i % (long)payloads);
    int n = snprintf(head, sizeof head, "PUB %s _INBOX.nl.%ld %zu\r\n", subject, i, payload_len[p]);
    out_put(head, (size_t)n);
    out_put(payload[p], payload_len[p]);
    out_put("\r\n", 2);
    started[i] = at;
    sent++;
}

/* ---- input: MSG / HMSG / PING / PONG / +OK / -ERR ---- */
static char *in;
static size_t in_len, in_cap;

static void on_reply(const char *subj, size_t subj_len, const char *body, size_t body_len, double t) {
    static const char prefix[] = "_INBOX.nl.";
    if (subj_len <= sizeof prefix - 1 || memcmp(subj, prefix, sizeof prefix - 1)) return;
    long i = strtol(subj + sizeof prefix - 1, NULL, 10);
    if (i < 0 || i >= sent || latency[i] >= 0) return;
    latency[i] = t - started[i];
    answered++;
    if (memmem(body, body_len, "\"allowed\":true", 14)) allowed++;
}

/* Parses what is complete in the input buffer; returns how many replies it saw. */
static long parse_input(double t) {
    long seen = 0;
    size_t pos = 0;
    for (;;) {
        char *eol = memmem(in + pos, in_len - pos, "\r\n", 2);
        if (!eol) break;
        char *line = in + pos;
        size_t line_len = (size_t)(eol - line);
        size_t next = pos + line_len + 2;
        if (line_len >= 4 && (!memcmp(line, "MSG ", 4) || !memcmp(line, "HMSG", 4))) {
            int headers = line[0] == 'H';
            char *tok[6];
            int ntok = 0;
            char *s = line;
            char *end = eol;
            while (s < end && ntok < 6) {
                while (s < end && *s == ' ') s++;
                if (s >= end) break;
                tok[ntok++] = s;
                while (s < end && *s != ' ') s++;
            }
            /* MSG subj sid [reply] size | HMSG subj sid [reply] hdr_size total_size */
            if (ntok < (headers ? 5 : 4)) { errno = 0; die("bad MSG line"); }
            size_t total = strtoul(tok[ntok - 1], NULL, 10);
            size_t hdr = headers ? strtoul(tok[ntok - 2], NULL, 10) : 0;
            if (in_len - next < total + 2) break; /* body not complete yet */
            char *subj_end = memchr(tok[1], ' ', (size_t)(end - tok[1]));
            on_reply(tok[1], (size_t)(subj_end - tok[1]), in + next + hdr, total - hdr, t);
            seen++;
            next += total + 2;
        } else if (line_len >= 4 && !memcmp(line, "PING", 4)) {
            out_put("PONG\r\n", 6);
        } else if (line_len >= 4 && !memcmp(line, "-ERR", 4)) {
            fprintf(stderr, "natsload: server said %.*s\n", (int)line_len, line);
            exit(1);
        } /* INFO, PONG, +OK: nothing to do */
        pos = next;
    }
    memmove(in, in + pos, in_len - pos);
    in_len -= pos;
    return seen;
}

static long read_input(void) {
    for (;;) {
        if (in_cap - in_len < 65536) {
            in_cap = in_cap * 2 + 65536;
            in = realloc(in, in_cap);
            if (!in) die("out of memory");
        }
        ssize_t r = read(sock, in + in_len, in_cap - in_len);
        if (r > 0) { in_len += (size_t)r; if ((size_t)r < in_cap - in_len) break; continue; }
        if (r == 0) { errno = 0; die("server closed the connection"); }
        if (errno == EINTR) continue;
        if (errno == EAGAIN) break;
        die("read");
    }
    return parse_input(now());
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: natsload HOST PORT SUBJECT PAYLOAD_FILE closed|open N CONCURRENCY|RATE\n");
        return 2;
    }
    prctl(PR_SET_TIMERSLACK, 1UL); /* wake when a request is due, not up to 50 us later */
    subject = argv[3];
    load_payloads(argv[4]);
    int open_loop = !strcmp(argv[5], "open");
    long n = atol(argv[6]);
    double param = atof(argv[7]);
    if (n <= 0 || param <= 0) { errno = 0; die("N and CONCURRENCY/RATE must be positive"); }
    started = calloc((size_t)n, sizeof *started);
    latency = malloc((size_t)n * sizeof *latency);
    late = calloc((size_t)n, sizeof *late);
    for (long i = 0; i < n; i++) latency[i] = -1;

    struct addrinfo hints = {0}, *ai;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(argv[1], argv[2], &hints, &ai)) die("getaddrinfo");
    sock = socket(ai->ai_family, SOCK_STREAM, 0);
    if (sock < 0 || connect(sock, ai->ai_addr, ai->ai_addrlen)) die("connect");
    freeaddrinfo(ai);
    int one = 1;
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

    const char hello[] = "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":true,"
                         "\"protocol\":1,\"name\":\"natsload\",\"lang\":\"c\",\"version\":\"1\"}\r\n"
                         "SUB _INBOX.nl.* 1\r\nPING\r\n";
    out_put(hello, sizeof hello - 1);
    flush_out(1);
    /* wait for the PONG that answers our PING: the subscription is in place */
    for (;;) {
        if (in_cap - in_len < 4096) { in_cap = in_cap * 2 + 65536; in = realloc(in, in_cap); }
        ssize_t r = read(sock, in + in_len, in_cap - in_len);
        if (r <= 0) die("handshake");
        in_len += (size_t)r;
        if (memmem(in, in_len, "PONG\r\n", 6)) break;
        if (memmem(in, in_len, "-ERR", 4)) { errno = 0; die("server refused the connection"); }
    }
    in_len = 0;
    fcntl(sock, F_SETFL, fcntl(sock, F_GETFL) | O_NONBLOCK);

    double t0 = now(), last_progress = t0;
    if (!open_loop) {
        long c = (long)param;
        for (long i = 0; i < c && sent < n; i++) send_request(sent, now());
        flush_out(0);
    }
    while (answered < n) {
        double t = now();
        struct timespec ts = {0, 100 * 1000000L};
        if (open_loop && sent < n) {
            long due = (long)((t - t0) * param) + 1;
            if (due > n) due = n;
            while (sent < due) {
                late[sent] = t - (t0 + sent / param);
                send_request(sent, t);
            }
            if (sent < n) {
                double wait = t0 + sent / param - now();
                if (wait < 0) wait = 0;
                ts.tv_sec = (time_t)wait;
                ts.tv_nsec = (long)((wait - (double)ts.tv_sec) * 1e9);
            }
        }
        flush_out(0);
        struct pollfd p = {sock, POLLIN | (out_len ? POLLOUT : 0), 0};
        int r = ppoll(&p, 1, &ts, NULL);
        if (r < 0 && errno != EINTR) die("poll");
        if (r > 0 && (p.revents & (POLLERR | POLLHUP))) { errno = 0; die("connection lost"); }
        if (r > 0 && (p.revents & POLLIN)) {
            long got = read_input();
            if (got) last_progress = now();
            if (!open_loop) {
                for (long k = 0; k < got && sent < n; k++) send_request(sent, now());
            }
        }
        if (now() - last_progress > 10) {
            errno = 0;
            fprintf(stderr, "natsload: %ld of %ld answered, none for 10 s\n", answered, n);
            return 1;
        }
    }
    double seconds = now() - t0;
    qsort(latency, (size_t)n, sizeof *latency, cmp);
    double p50 = n % 2 ? latency[n / 2] : (latency[n / 2 - 1] + latency[n / 2]) / 2;
    qsort(late, (size_t)n, sizeof *late, cmp);
    printf("{\"requests\": %ld, \"seconds\": %.6f, \"per_s\": %.1f, \"p50_ms\": %.3f, \"p99_ms\": %.3f, "
           "\"max_ms\": %.3f, \"allowed\": %ld, \"client_late_p99_ms\": %.3f, \"client_late_max_ms\": %.3f}\n",
           n, seconds, n / seconds, p50 * 1000, latency[(long)(n * 0.99)] * 1000, latency[n - 1] * 1000, allowed,
           late[(long)(n * 0.99)] * 1000, late[n - 1] * 1000);
    return 0;
}
