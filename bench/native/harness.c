/*
 * The benchmark harness in C: a clocked fake engine, a closed-loop load generator and a
 * CPU-bound spin loop, so that on a small machine the harness costs a few µs per relayed chunk
 * instead of the ~60 µs of the Python harness (bench/fastengine.py + bench/loadgen.py).
 *
 *   harness engine [--port P] [--ttft-ms X] [--itl-ms X] [--tokens N] [--incremental]
 *                  [--batch-us U]
 *       The wire behaviour of bench/fastengine.py (see its docstring): SGLang's native
 *       POST /generate (streaming), POST /v1/chat/completions (OpenAI, streaming, n choices),
 *       POST /abort_request, GET /health, /health_generate, /ready, /server_info,
 *       /model_info, /v1/models, /_bench/stats. HTTP/1.1 keep-alive, chunked SSE responses.
 *       One thread, epoll, a binary heap of token deadlines driven by a timerfd; each pass
 *       emits every token due within --batch-us (default 200, fastengine's figure), and the
 *       chunks of one connection due in the same pass go out in one send().
 *
 *   harness load '<json config>'
 *       bench/loadgen.py's closed loop (see its docstring) for fanout = 1: `concurrency`
 *       clients, each on its own keep-alive connection. The measurement window is given as
 *       absolute CLOCK_MONOTONIC seconds (`window_start`, `window_end`), the clock of
 *       Python's time.monotonic(), so the caller samples /proc at the same instants. Result
 *       JSON on stdout, `PROGRESS {...}` lines on stderr once a second.
 *
 *   harness spin SECONDS
 *       A CPU-bound loop for SECONDS of wall time; prints {"iterations":N,"seconds":S}.
 *
 * C11 + POSIX + Linux (epoll, timerfd). Built by bench/native.py.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

/* ---- utilities ------------------------------------------------------------------------- */

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("harness: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        die("out of memory");
    return q;
}

static void *xcalloc(size_t n, size_t size)
{
    void *q = calloc(n ? n : 1, size ? size : 1);
    if (!q)
        die("out of memory");
    return q;
}

/* A growable byte buffer. */
typedef struct {
    char *p;
    size_t len, cap;
} buf_t;

static void buf_reserve(buf_t *b, size_t extra)
{
    if (b->len + extra <= b->cap)
        return;
    size_t c = b->cap ? b->cap : 256;
    while (c < b->len + extra)
        c *= 2;
    b->p = xrealloc(b->p, c);
    b->cap = c;
}

static void buf_add(buf_t *b, const void *d, size_t n)
{
    if (!n)
        return;
    buf_reserve(b, n);
    memcpy(b->p + b->len, d, n);
    b->len += n;
}

static void buf_adds(buf_t *b, const char *s) { buf_add(b, s, strlen(s)); }

__attribute__((format(printf, 2, 3))) static void buf_addf(buf_t *b, const char *fmt, ...)
{
    va_list ap;
    buf_reserve(b, 128);
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0)
        die("vsnprintf failed");
    if ((size_t)n >= b->cap - b->len) {
        buf_reserve(b, (size_t)n + 1);
        va_start(ap, fmt);
        vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
    }
    b->len += (size_t)n;
}

/* Drop the first n bytes. */
static void buf_consume(buf_t *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

static void buf_free(buf_t *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* zlib's CRC-32 (the seed fastengine derives from a rid). */
static uint32_t crc_table[256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_of(const char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++)
        c = crc_table[(c ^ (unsigned char)p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* xorshift64* */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static double rng_unit(void) { return (double)(rng_next() >> 11) / 9007199254740992.0; }

static void rng_seed(uint64_t s)
{
    rng_state = s * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    if (!rng_state)
        rng_state = 1;
    for (int i = 0; i < 8; i++)
        rng_next();
}

static void set_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max < 65536 ? rl.rlim_max : 65536;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* ---- a small JSON scanner (validates while skipping; no tree) ----------------------------- */

static const char *jws(const char *p, const char *e)
{
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

/* p at '"': the byte after the closing quote, or NULL. */
static const char *jstr_end(const char *p, const char *e)
{
    for (p++; p < e; p++) {
        unsigned char ch = (unsigned char)*p;
        if (ch == '\\') {
            if (++p >= e)
                return NULL;
        } else if (ch == '"') {
            return p + 1;
        } else if (ch < 0x20) {
            return NULL;
        }
    }
    return NULL;
}

static const char *jlit(const char *p, const char *e, const char *lit)
{
    size_t n = strlen(lit);
    return ((size_t)(e - p) >= n && memcmp(p, lit, n) == 0) ? p + n : NULL;
}

/* Skip one value (after leading whitespace); the byte after it, or NULL if malformed. */
static const char *jskip(const char *p, const char *e, int depth)
{
    p = jws(p, e);
    if (p >= e || depth > 64)
        return NULL;
    switch (*p) {
    case '"':
        return jstr_end(p, e);
    case '{':
    case '[': {
        char close = *p == '{' ? '}' : ']';
        p = jws(p + 1, e);
        if (p < e && *p == close)
            return p + 1;
        for (;;) {
            if (close == '}') {
                p = jws(p, e);
                if (p >= e || *p != '"' || !(p = jstr_end(p, e)))
                    return NULL;
                p = jws(p, e);
                if (p >= e || *p != ':')
                    return NULL;
                p++;
            }
            if (!(p = jskip(p, e, depth + 1)))
                return NULL;
            p = jws(p, e);
            if (p >= e)
                return NULL;
            if (*p == ',') {
                p++;
                continue;
            }
            return *p == close ? p + 1 : NULL;
        }
    }
    case 't':
        return jlit(p, e, "true");
    case 'f':
        return jlit(p, e, "false");
    case 'n':
        return jlit(p, e, "null");
    default: {
        const char *s = p;
        while (p < e && (strchr("+-.eE", *p) || (*p >= '0' && *p <= '9')))
            p++;
        return p > s ? p : NULL;
    }
    }
}

/* Is [p, e) exactly one JSON object (plus whitespace)? */
static int jobject_ok(const char *p, const char *e)
{
    p = jws(p, e);
    if (p >= e || *p != '{')
        return 0;
    const char *q = jskip(p, e, 0);
    return q && jws(q, e) == e;
}

/* In the (valid) object starting at p, find member `key` (a key without escapes); its value
 * is [*vs, *ve). Returns 1 if found. */
static int jget(const char *p, const char *e, const char *key, const char **vs, const char **ve)
{
    size_t kl = strlen(key);
    p = jws(p, e);
    if (p >= e || *p != '{')
        return 0;
    p = jws(p + 1, e);
    if (p < e && *p == '}')
        return 0;
    for (;;) {
        p = jws(p, e);
        if (p >= e || *p != '"')
            return 0;
        const char *ks = p + 1, *kend = jstr_end(p, e);
        if (!kend)
            return 0;
        int match = (size_t)(kend - 1 - ks) == kl && memcmp(ks, key, kl) == 0;
        p = jws(kend, e);
        if (p >= e || *p != ':')
            return 0;
        const char *v = jws(p + 1, e);
        const char *vend = jskip(v, e, 1);
        if (!vend)
            return 0;
        if (match) {
            *vs = v;
            *ve = vend;
            return 1;
        }
        p = jws(vend, e);
        if (p >= e || *p != ',')
            return 0;
        p++;
    }
}

static int jis(const char *vs, const char *ve, const char *lit)
{
    size_t n = strlen(lit);
    return (size_t)(ve - vs) == n && memcmp(vs, lit, n) == 0;
}

/* A number value as a double; 0 if not a number. */
static int jnum(const char *vs, const char *ve, double *out)
{
    char tmp[64];
    size_t n = (size_t)(ve - vs);
    if (n == 0 || n >= sizeof tmp || !(*vs == '-' || (*vs >= '0' && *vs <= '9')))
        return 0;
    memcpy(tmp, vs, n);
    tmp[n] = 0;
    char *end;
    *out = strtod(tmp, &end);
    return *end == 0;
}

/* A string value's raw (still escaped) contents. */
static int jstr_raw(const char *vs, const char *ve, const char **s, size_t *n)
{
    if (ve - vs < 2 || *vs != '"')
        return 0;
    *s = vs + 1;
    *n = (size_t)(ve - vs - 2);
    return 1;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static void utf8_put(buf_t *b, uint32_t cp)
{
    char o[4];
    size_t n;
    if (cp < 0x80) {
        o[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        o[0] = (char)(0xF0 | (cp >> 18));
        o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    buf_add(b, o, n);
}

/* Decode a string value (with its quotes) into a NUL-terminated buffer; 0 if malformed. */
static int jstr_decode(const char *vs, const char *ve, buf_t *out)
{
    const char *s;
    size_t n;
    out->len = 0;
    if (!jstr_raw(vs, ve, &s, &n))
        return 0;
    const char *e = s + n;
    while (s < e) {
        if (*s != '\\') {
            buf_add(out, s++, 1);
            continue;
        }
        if (++s >= e)
            return 0;
        char c = *s++;
        const char *map = strchr("\"\"\\\\//b\bf\fn\nr\rt\t", c);
        if (c != 'u') {
            if (!c || !map || (map - "\"\"\\\\//b\bf\fn\nr\rt\t") % 2)
                return 0;
            buf_add(out, map + 1, 1);
            continue;
        }
        uint32_t cp = 0;
        for (int k = 0; k < 4; k++) {
            int h = s < e ? hexval(*s++) : -1;
            if (h < 0)
                return 0;
            cp = cp * 16 + (uint32_t)h;
        }
        if (cp >= 0xD800 && cp < 0xDC00 && e - s >= 6 && s[0] == '\\' && s[1] == 'u') {
            uint32_t lo = 0;
            int ok = 1;
            for (int k = 2; k < 6; k++) {
                int h = hexval(s[k]);
                if (h < 0)
                    ok = 0;
                lo = lo * 16 + (uint32_t)(h < 0 ? 0 : h);
            }
            if (ok && lo >= 0xDC00 && lo < 0xE000) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                s += 6;
            }
        }
        utf8_put(out, cp);
    }
    buf_add(out, "", 1);
    out->len--;
    return 1;
}

/* ==== engine mode ========================================================================= */

/* Tokens: engine.fake.default_tokens: word w = (seed + i * 7919) % 5625 is " " + two of the
 * 75 consonant-vowel syllables, its id 1000 + w; consecutive tokens always differ. */
#define VOCAB 5625
#define STEP 7919
static char words[VOCAB][6];

static void words_init(void)
{
    static const char cons[] = "bdfghklmnprstvz", vow[] = "aeiou";
    for (int w = 0; w < VOCAB; w++) {
        int a = w / 75, b = w % 75;
        words[w][0] = ' ';
        words[w][1] = cons[a / 5];
        words[w][2] = vow[a % 5];
        words[w][3] = cons[b / 5];
        words[w][4] = vow[b % 5];
        words[w][5] = 0;
    }
}

static int word_at(uint64_t seed, int i) { return (int)((seed + (uint64_t)i * STEP) % VOCAB); }

typedef struct econn econn_t;

typedef struct gen {
    econn_t *conn;
    char *rid;
    size_t ridlen;
    int index;         /* choice index (chat) */
    uint64_t seed;
    int total, limit, i;
    int done;
    int64_t due;
    uint64_t seq;
    int hidx;          /* position in the heap, -1 when not in it */
    int running;       /* in the rid map */
    struct gen *hnext; /* rid map chain */
} gen_t;

struct econn {
    int fd;
    uint32_t events;
    buf_t in, out;
    size_t outoff;
    int dead, closing, close_after, touched, queued_ready, queued_close;
    int busy; /* a streaming response is open */
    gen_t *gens;
    int ngens, left;
    int chat;
    buf_t pre;  /* chat chunk prefix, up to `"index":` */
    buf_t fins; /* finish chunks, written when the last generation ends */
};

static struct {
    int64_t ttft, itl, batch;
    int tokens, incremental;
    int ep, lfd, tfd;
    int64_t armed;
    gen_t **heap;
    int hn, hcap;
    uint64_t seq;
    gen_t *map[1 << 16];
    int nrunning;
    econn_t **touched, **ready, **closing;
    int ntouched, nready, nclosing, cap_touched, cap_ready, cap_closing;
    buf_t scratch;
    uint64_t c_connections, c_requests, c_generate, c_chat, c_streams_started, c_finished,
        c_aborted, c_cancelled, c_aborts_received, c_chunks_sent, c_late, c_stalled, c_passes;
} E;

static int tag_listen, tag_timer;

#define OUT_HIGH_WATER (1u << 20)
#define IN_LIMIT (1u << 24)

/* -- the deadline heap, ordered by (due, seq) -- */
static int gen_before(const gen_t *a, const gen_t *b)
{
    return a->due < b->due || (a->due == b->due && a->seq < b->seq);
}

static void heap_set(int i, gen_t *g)
{
    E.heap[i] = g;
    g->hidx = i;
}

static void heap_up(int i)
{
    gen_t *g = E.heap[i];
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!gen_before(g, E.heap[p]))
            break;
        heap_set(i, E.heap[p]);
        i = p;
    }
    heap_set(i, g);
}

static void heap_down(int i)
{
    gen_t *g = E.heap[i];
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        const gen_t *best = g;
        if (l < E.hn && gen_before(E.heap[l], best)) {
            m = l;
            best = E.heap[l];
        }
        if (r < E.hn && gen_before(E.heap[r], best))
            m = r;
        if (m == i)
            break;
        heap_set(i, E.heap[m]);
        i = m;
    }
    heap_set(i, g);
}

static void heap_push(gen_t *g, int64_t due)
{
    if (E.hn == E.hcap) {
        E.hcap = E.hcap ? E.hcap * 2 : 1024;
        E.heap = xrealloc(E.heap, (size_t)E.hcap * sizeof *E.heap);
    }
    g->due = due;
    g->seq = E.seq++;
    heap_set(E.hn++, g);
    heap_up(E.hn - 1);
}

static gen_t *heap_pop(void)
{
    gen_t *top = E.heap[0];
    top->hidx = -1;
    if (--E.hn > 0) {
        heap_set(0, E.heap[E.hn]);
        heap_down(0);
    }
    return top;
}

static void heap_remove(gen_t *g)
{
    int i = g->hidx;
    if (i < 0)
        return;
    g->hidx = -1;
    if (--E.hn == i)
        return;
    heap_set(i, E.heap[E.hn]);
    heap_down(i);
    heap_up(E.heap[i]->hidx);
}

/* -- the rid map (the generations /abort_request can reach) -- */
static unsigned rid_hash(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h & ((1u << 16) - 1);
}

static void map_add(gen_t *g)
{
    unsigned h = rid_hash(g->rid, g->ridlen);
    g->hnext = E.map[h];
    E.map[h] = g;
    g->running = 1;
    E.nrunning++;
}

static void map_del(gen_t *g)
{
    if (!g->running)
        return;
    gen_t **pp = &E.map[rid_hash(g->rid, g->ridlen)];
    while (*pp && *pp != g)
        pp = &(*pp)->hnext;
    if (*pp)
        *pp = g->hnext;
    g->running = 0;
    E.nrunning--;
}

static gen_t *map_get(const char *rid, size_t n)
{
    for (gen_t *g = E.map[rid_hash(rid, n)]; g; g = g->hnext)
        if (g->ridlen == n && memcmp(g->rid, rid, n) == 0)
            return g;
    return NULL;
}

/* -- connection lists -- */
static void list_push(econn_t ***arr, int *n, int *cap, econn_t *c)
{
    if (*n == *cap) {
        *cap = *cap ? *cap * 2 : 256;
        *arr = xrealloc(*arr, (size_t)*cap * sizeof **arr);
    }
    (*arr)[(*n)++] = c;
}

static void touch(econn_t *c)
{
    if (!c->touched) {
        c->touched = 1;
        list_push(&E.touched, &E.ntouched, &E.cap_touched, c);
    }
}

static void queue_close(econn_t *c)
{
    c->dead = 1;
    if (!c->queued_close) {
        c->queued_close = 1;
        list_push(&E.closing, &E.nclosing, &E.cap_closing, c);
    }
}

static void queue_ready(econn_t *c)
{
    if (!c->queued_ready) {
        c->queued_ready = 1;
        list_push(&E.ready, &E.nready, &E.cap_ready, c);
    }
}

static void set_events(econn_t *c, uint32_t ev)
{
    if (c->events == ev)
        return;
    struct epoll_event e = {.events = ev, .data.ptr = c};
    if (epoll_ctl(E.ep, EPOLL_CTL_MOD, c->fd, &e) == 0)
        c->events = ev;
}

/* Send p[*off..len) without blocking. 0: all sent; 1: the socket is full; -1: it failed. */
static int send_some(int fd, const char *p, size_t len, size_t *off)
{
    while (*off < len) {
        ssize_t n = send(fd, p + *off, len - *off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0)
            *off += (size_t)n;
        else if (n < 0 && errno == EINTR)
            continue;
        else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 1;
        else
            return -1;
    }
    return 0;
}

/* Write what is pending; `writable`: called on EPOLLOUT (else skipped while waiting for it). */
static void flush(econn_t *c, int writable)
{
    if (c->dead || (!writable && (c->events & EPOLLOUT)))
        return;
    int r = send_some(c->fd, c->out.p, c->out.len, &c->outoff);
    if (r == 1) {
        set_events(c, EPOLLIN | EPOLLOUT);
        return;
    }
    if (r < 0) {
        queue_close(c);
        return;
    }
    c->out.len = 0;
    c->outoff = 0;
    set_events(c, EPOLLIN);
    if (c->closing)
        queue_close(c);
}

static size_t out_pending(const econn_t *c) { return c->out.len - c->outoff; }

/* Append one HTTP/1.1 chunk holding `payload`. */
static void put_chunk(buf_t *b, const char *payload, size_t n)
{
    buf_addf(b, "%zx\r\n", n);
    buf_add(b, payload, n);
    buf_add(b, "\r\n", 2);
}

static const char HEAD_SSE[] = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                               "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";

static void json_response(econn_t *c, int status, const char *body)
{
    const char *reason = status == 200   ? "OK"
                         : status == 400 ? "Bad Request"
                         : status == 404 ? "Not Found"
                         : status == 413 ? "Payload Too Large"
                         : status == 431 ? "Request Header Fields Too Large"
                         : status == 501 ? "Not Implemented"
                                         : "OK";
    buf_addf(&c->out, "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n\r\n",
             status, reason, strlen(body));
    buf_adds(&c->out, body);
    touch(c);
}

static void free_gens(econn_t *c)
{
    for (int k = 0; k < c->ngens; k++)
        free(c->gens[k].rid);
    free(c->gens);
    c->gens = NULL;
    c->ngens = 0;
}

static gen_t *new_gens(econn_t *c, int n)
{
    free_gens(c);
    c->gens = xcalloc((size_t)n, sizeof *c->gens);
    c->ngens = n;
    c->left = n;
    c->busy = 1;
    c->fins.len = 0;
    for (int k = 0; k < n; k++) {
        c->gens[k].conn = c;
        c->gens[k].index = k;
        c->gens[k].hidx = -1;
    }
    return c->gens;
}

static void start_gens(econn_t *c)
{
    int64_t due = now_ns() + E.ttft;
    buf_add(&c->out, HEAD_SSE, sizeof HEAD_SSE - 1);
    touch(c);
    for (int k = 0; k < c->ngens; k++) {
        map_add(&c->gens[k]);
        heap_push(&c->gens[k], due);
    }
    E.c_streams_started += (uint64_t)c->ngens;
}

/* A generation ended (finished or aborted); `fin` is an extra chunk (already framed) that goes
 * out with the end of the response. The response ends when its last generation does. */
static void end_gen(gen_t *g, const buf_t *fin)
{
    econn_t *c = g->conn;
    g->done = 1;
    map_del(g);
    heap_remove(g);
    if (fin)
        buf_add(&c->fins, fin->p, fin->len);
    if (--c->left > 0)
        return;
    buf_add(&c->out, c->fins.p, c->fins.len);
    put_chunk(&c->out, "data: [DONE]\n\n", 14);
    buf_add(&c->out, "0\r\n\r\n", 5);
    c->fins.len = 0;
    c->busy = 0;
    touch(c);
    if (c->close_after)
        c->closing = 1;
    else if (c->in.len)
        queue_ready(c);
}

static void sse_open(buf_t *b) { buf_add(b, "data: ", 6); }
static void sse_close(buf_t *b) { buf_add(b, "\n\n", 2); }

/* The cumulative text of tokens [0, n). */
static void add_text_upto(buf_t *b, const gen_t *g, int n)
{
    for (int k = 0; k < n; k++)
        buf_add(b, words[word_at(g->seed, k)], 5);
}

/* The chunk for token g->i (fastengine's _token_chunk), framed, appended to the output. */
static void token_chunk(gen_t *g)
{
    econn_t *c = g->conn;
    buf_t *s = &E.scratch;
    int i = g->i;
    s->len = 0;
    if (c->chat) {
        if (i == 0) {
            sse_open(s);
            buf_add(s, c->pre.p, c->pre.len);
            buf_addf(s, "%d,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                        "\"logprobs\":null,\"finish_reason\":null}]}", g->index);
            sse_close(s);
        }
        sse_open(s);
        buf_add(s, c->pre.p, c->pre.len);
        buf_addf(s, "%d,\"delta\":{\"content\":\"%s\"},\"logprobs\":null,\"finish_reason\":null}]}",
                 g->index, words[word_at(g->seed, i)]);
        sse_close(s);
    } else {
        sse_open(s);
        buf_adds(s, "{\"text\":\"");
        if (E.incremental)
            buf_add(s, words[word_at(g->seed, i)], 5);
        else
            add_text_upto(s, g, i + 1);
        buf_adds(s, "\",\"output_ids\":[");
        if (E.incremental) {
            buf_addf(s, "%d", 1000 + word_at(g->seed, i));
        } else {
            for (int k = 0; k <= i; k++)
                buf_addf(s, k ? ",%d" : "%d", 1000 + word_at(g->seed, k));
        }
        buf_adds(s, "],\"meta_info\":{\"id\":\"");
        buf_add(s, g->rid, g->ridlen);
        buf_adds(s, "\",\"finish_reason\":");
        if (i + 1 == g->total) {
            if (g->total == g->limit)
                buf_addf(s, "{\"type\":\"length\",\"length\":%d}", g->total);
            else
                buf_adds(s, "{\"type\":\"stop\",\"matched\":2}");
        } else {
            buf_adds(s, "null");
        }
        buf_addf(s, ",\"prompt_tokens\":8,\"completion_tokens\":%d,\"cached_tokens\":0,"
                    "\"reasoning_tokens\":0,\"weight_version\":\"default\"}}", i + 1);
        sse_close(s);
    }
    put_chunk(&c->out, s->p, s->len);
}

static void abort_gen(gen_t *g)
{
    if (g->done)
        return;
    econn_t *c = g->conn;
    E.c_aborted++;
    buf_t *s = &E.scratch;
    s->len = 0;
    sse_open(s);
    if (c->chat) {
        buf_add(s, c->pre.p, c->pre.len);
        buf_addf(s, "%d,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"abort\"}]}", g->index);
    } else {
        buf_adds(s, "{\"text\":\"");
        add_text_upto(s, g, g->i);
        buf_addf(s, "\",\"output_ids\":[%d],\"meta_info\":{\"id\":\"",
                 1000 + word_at(g->seed, g->i > 0 ? g->i - 1 : 0));
        buf_add(s, g->rid, g->ridlen);
        buf_addf(s, "\",\"finish_reason\":{\"type\":\"abort\",\"message\":\"Aborted\","
                    "\"status_code\":null,\"err_type\":null},\"prompt_tokens\":8,"
                    "\"completion_tokens\":%d,\"cached_tokens\":0,\"reasoning_tokens\":0,"
                    "\"weight_version\":\"default\"}}", g->i);
    }
    sse_close(s);
    buf_t fin = {0};
    put_chunk(&fin, s->p, s->len);
    E.c_chunks_sent++;
    end_gen(g, &fin);
    buf_free(&fin);
}

static void random_hex(char *out, int n)
{
    static const char hx[] = "0123456789abcdef";
    for (int k = 0; k < n; k++)
        out[k] = hx[rng_next() >> 60];
    out[n] = 0;
}

static void set_rid(gen_t *g, const char *s, size_t n)
{
    g->rid = xrealloc(NULL, n + 1);
    memcpy(g->rid, s, n);
    g->rid[n] = 0;
    g->ridlen = n;
}

static void route_generate(econn_t *c, const char *b, const char *e)
{
    const char *vs, *ve;
    E.c_generate++;
    if (!jobject_ok(b, e)) {
        json_response(c, 400, "{\"error\":{\"message\":\"bench: body is not a JSON object\"}}");
        return;
    }
    int limit = 128;
    const char *ss, *se;
    if (jget(b, e, "sampling_params", &ss, &se) && *ss == '{' && jget(ss, se, "max_new_tokens", &vs, &ve)) {
        double d;
        if (jis(vs, ve, "null"))
            limit = 1 << 30;
        else if (jnum(vs, ve, &d))
            limit = d < 1 ? 1 : d > (1 << 30) ? 1 << 30 : (int)d;
    }
    if (!(jget(b, e, "stream", &vs, &ve) && jis(vs, ve, "true"))) {
        json_response(c, 400, "{\"error\":{\"message\":\"bench: stream only\"}}");
        return;
    }
    c->chat = 0;
    gen_t *g = new_gens(c, 1);
    const char *rs;
    size_t rn;
    if (jget(b, e, "rid", &vs, &ve) && jstr_raw(vs, ve, &rs, &rn) && rn > 0) {
        set_rid(g, rs, rn);
    } else {
        char hx[33];
        random_hex(hx, 32);
        set_rid(g, hx, 32);
    }
    g->seed = crc32_of(g->rid, g->ridlen);
    g->limit = limit;
    g->total = E.tokens < limit ? E.tokens : limit;
    start_gens(c);
}

static void route_chat(econn_t *c, const char *b, const char *e)
{
    const char *vs, *ve;
    double d;
    E.c_chat++;
    if (!jobject_ok(b, e)) {
        json_response(c, 400, "{\"error\":{\"message\":\"bench: body is not a JSON object\"}}");
        return;
    }
    int n = 1;
    if (jget(b, e, "n", &vs, &ve) && jnum(vs, ve, &d) && d >= 1)
        n = d > 1024 ? 1024 : (int)d;
    int limit = 1 << 30;
    int have = jget(b, e, "max_completion_tokens", &vs, &ve) || jget(b, e, "max_tokens", &vs, &ve);
    if (have && jnum(vs, ve, &d) && d >= 1)
        limit = d > (1 << 30) ? 1 << 30 : (int)d;
    if (!(jget(b, e, "stream", &vs, &ve) && jis(vs, ve, "true"))) {
        json_response(c, 400, "{\"error\":{\"message\":\"bench: stream only\"}}");
        return;
    }
    char cid[64] = "chatcmpl-";
    random_hex(cid + 9, 32);
    const char *model = "bench-model";
    size_t mlen = strlen(model);
    if (jget(b, e, "model", &vs, &ve))
        jstr_raw(vs, ve, &model, &mlen);
    uint32_t mseed = 0;
    if (jget(b, e, "messages", &vs, &ve))
        mseed = crc32_of(vs, (size_t)(ve - vs));
    c->chat = 1;
    c->pre.len = 0;
    buf_addf(&c->pre, "{\"id\":\"%s\",\"object\":\"chat.completion.chunk\",\"created\":%ld,\"model\":\"",
             cid, (long)time(NULL));
    buf_add(&c->pre, model, mlen);
    buf_adds(&c->pre, "\",\"choices\":[{\"index\":");
    uint64_t seed = (uint64_t)(mseed ^ crc32_of(cid, strlen(cid)));
    gen_t *gs = new_gens(c, n);
    for (int k = 0; k < n; k++) {
        char rid[80];
        if (n == 1)
            snprintf(rid, sizeof rid, "%s", cid);
        else
            snprintf(rid, sizeof rid, "%s_%d", cid, k);
        set_rid(&gs[k], rid, strlen(rid));
        gs[k].seed = seed + 104729ull * (uint64_t)k;
        gs[k].limit = limit;
        gs[k].total = E.tokens < limit ? E.tokens : limit;
    }
    start_gens(c);
}

static void route_abort(econn_t *c, const char *b, const char *e)
{
    const char *vs, *ve, *rs;
    size_t rn;
    E.c_aborts_received++;
    if (jobject_ok(b, e) && jget(b, e, "rid", &vs, &ve) && jstr_raw(vs, ve, &rs, &rn)) {
        gen_t *g = map_get(rs, rn);
        if (g)
            abort_gen(g);
    }
    json_response(c, 200, "{}");
}

static void route_stats(econn_t *c)
{
    char body[1024];
    snprintf(body, sizeof body,
             "{\"connections\":%llu,\"requests\":%llu,\"generate\":%llu,\"chat\":%llu,"
             "\"streams_started\":%llu,\"finished\":%llu,\"aborted\":%llu,\"cancelled\":%llu,"
             "\"aborts_received\":%llu,\"chunks_sent\":%llu,\"late\":%llu,\"stalled\":%llu,"
             "\"passes\":%llu,"
             "\"running\":%d}",
             (unsigned long long)E.c_connections, (unsigned long long)E.c_requests,
             (unsigned long long)E.c_generate, (unsigned long long)E.c_chat,
             (unsigned long long)E.c_streams_started, (unsigned long long)E.c_finished,
             (unsigned long long)E.c_aborted, (unsigned long long)E.c_cancelled,
             (unsigned long long)E.c_aborts_received, (unsigned long long)E.c_chunks_sent,
             (unsigned long long)E.c_late, (unsigned long long)E.c_stalled,
             (unsigned long long)E.c_passes, E.nrunning);
    json_response(c, 200, body);
}

static int path_is(const char *p, size_t n, const char *lit)
{
    return strlen(lit) == n && memcmp(p, lit, n) == 0;
}

static void route(econn_t *c, const char *m, size_t mn, const char *p, size_t pn, const char *b,
                  size_t bn)
{
    const char *q = memchr(p, '?', pn);
    if (q)
        pn = (size_t)(q - p);
    int post = path_is(m, mn, "POST");
    if (post && path_is(p, pn, "/generate")) {
        route_generate(c, b, b + bn);
    } else if (post && path_is(p, pn, "/v1/chat/completions")) {
        route_chat(c, b, b + bn);
    } else if (post && path_is(p, pn, "/abort_request")) {
        route_abort(c, b, b + bn);
    } else if (path_is(p, pn, "/health") || path_is(p, pn, "/health_generate") ||
               path_is(p, pn, "/ready")) {
        buf_adds(&c->out, "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        touch(c);
    } else if (path_is(p, pn, "/server_info") || path_is(p, pn, "/get_server_info")) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"model_path\":\"bench-model\",\"tokenizer_path\":\"bench-model\","
                 "\"served_model_name\":\"bench-model\",\"context_length\":8192,"
                 "\"incremental_streaming_output\":%s,\"version\":\"0.5.23\","
                 "\"frontend\":\"bench-native\"}",
                 E.incremental ? "true" : "false");
        json_response(c, 200, body);
    } else if (path_is(p, pn, "/model_info") || path_is(p, pn, "/get_model_info")) {
        json_response(c, 200, "{\"model_path\":\"bench-model\",\"tokenizer_path\":\"bench-model\","
                              "\"is_generation\":true}");
    } else if (path_is(p, pn, "/v1/models")) {
        json_response(c, 200, "{\"object\":\"list\",\"data\":[{\"id\":\"bench-model\","
                              "\"object\":\"model\",\"owned_by\":\"bench\"}]}");
    } else if (path_is(p, pn, "/_bench/stats")) {
        route_stats(c);
    } else {
        json_response(c, 404, "{\"detail\":\"Not Found\"}");
    }
}

/* Case-insensitive: does header line [s, e) have name `name`? Sets *v to its trimmed value. */
static int header_is(const char *s, const char *e, const char *name, const char **v,
                     const char **ve)
{
    size_t n = strlen(name);
    if ((size_t)(e - s) <= n || strncasecmp(s, name, n) != 0)
        return 0;
    const char *p = s + n;
    while (p < e && (*p == ' ' || *p == '\t'))
        p++;
    if (p >= e || *p != ':')
        return 0;
    p++;
    while (p < e && (*p == ' ' || *p == '\t'))
        p++;
    while (e > p && (e[-1] == ' ' || e[-1] == '\t'))
        e--;
    *v = p;
    *ve = e;
    return 1;
}

static int contains_ci(const char *s, const char *e, const char *word)
{
    size_t n = strlen(word);
    for (; (size_t)(e - s) >= n; s++)
        if (strncasecmp(s, word, n) == 0)
            return 1;
    return 0;
}

/* Parse and serve every complete request in c->in (stops while a stream is open). */
static void process_input(econn_t *c)
{
    while (!c->busy && !c->dead && !c->closing && c->in.len) {
        char *base = c->in.p;
        if (!base)
            return;
        char *he = memmem(base, c->in.len, "\r\n\r\n", 4);
        if (!he) {
            if (c->in.len > 65536) {
                json_response(c, 431, "{\"detail\":\"request head too large\"}");
                c->closing = 1;
            }
            return;
        }
        char *le = memmem(base, (size_t)(he - base), "\r\n", 2);
        if (!le)
            le = he;
        char *sp1 = memchr(base, ' ', (size_t)(le - base));
        char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(le - sp1 - 1)) : NULL;
        if (!sp1 || !sp2 || sp1 == base || sp2 == sp1 + 1) {
            json_response(c, 400, "{\"detail\":\"bad request line\"}");
            c->closing = 1;
            return;
        }
        long long clen = 0;
        int bad = 0;
        c->close_after = 0;
        for (char *ls = le + 2; ls < he;) {
            char *nl = memmem(ls, (size_t)(he + 2 - ls), "\r\n", 2);
            const char *v, *ve;
            if (header_is(ls, nl, "content-length", &v, &ve)) {
                char *end;
                clen = strtoll(v, &end, 10);
                if (end != ve || clen < 0)
                    bad = 400;
            } else if (header_is(ls, nl, "transfer-encoding", &v, &ve)) {
                bad = 501; /* request bodies come with content-length here */
            } else if (header_is(ls, nl, "connection", &v, &ve) && contains_ci(v, ve, "close")) {
                c->close_after = 1;
            }
            ls = nl + 2;
        }
        if (bad || clen > IN_LIMIT) {
            json_response(c, bad == 501 ? 501 : bad ? 400 : 413,
                          "{\"detail\":\"unsupported request framing\"}");
            c->closing = 1;
            return;
        }
        size_t hlen = (size_t)(he + 4 - base);
        if (c->in.len < hlen + (size_t)clen)
            return;
        E.c_requests++;
        route(c, base, (size_t)(sp1 - base), sp1 + 1, (size_t)(sp2 - sp1 - 1), he + 4,
              (size_t)clen);
        buf_consume(&c->in, hlen + (size_t)clen);
        if (!c->busy && c->close_after)
            c->closing = 1;
    }
}

static void conn_read(econn_t *c)
{
    for (int rounds = 0; rounds < 4; rounds++) {
        buf_reserve(&c->in, 65536);
        ssize_t n = recv(c->fd, c->in.p + c->in.len, c->in.cap - c->in.len, MSG_DONTWAIT);
        if (n > 0) {
            c->in.len += (size_t)n;
            if (c->in.len > IN_LIMIT + 65536u) {
                queue_close(c);
                return;
            }
            if ((size_t)n < 65536)
                break;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        queue_close(c); /* EOF or error: a closed connection cancels its generations */
        return;
    }
    process_input(c);
}

static void conn_free(econn_t *c)
{
    for (int k = 0; k < c->ngens; k++) {
        gen_t *g = &c->gens[k];
        if (!g->done) {
            g->done = 1;
            map_del(g);
            heap_remove(g);
            E.c_cancelled++;
        }
    }
    free_gens(c);
    epoll_ctl(E.ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    buf_free(&c->in);
    buf_free(&c->out);
    buf_free(&c->pre);
    buf_free(&c->fins);
    free(c);
}

static void do_accept(void)
{
    for (;;) {
        int fd = accept4(E.lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                fprintf(stderr, "harness engine: accept: %s\n", strerror(errno));
            return;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        econn_t *c = xcalloc(1, sizeof *c);
        c->fd = fd;
        c->events = EPOLLIN;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(E.ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
            close(fd);
            free(c);
            continue;
        }
        E.c_connections++;
    }
}

/* One pass of the decode clock: every generation due (within 0.2 ms) emits its next token. */
static void clock_pass(void)
{
    static gen_t **batch;
    static int bcap;
    int64_t now = now_ns();
    int64_t limit = now + E.batch;
    E.c_passes++;
    int nb = 0;
    while (E.hn && E.heap[0]->due <= limit) {
        if (nb == bcap) {
            bcap = bcap ? bcap * 2 : 1024;
            batch = xrealloc(batch, (size_t)bcap * sizeof *batch);
        }
        batch[nb++] = heap_pop();
    }
    int64_t late_after = E.itl > 1000000 ? E.itl : 1000000;
    for (int k = 0; k < nb; k++) {
        gen_t *g = batch[k];
        econn_t *c = g->conn;
        if (g->done || c->dead)
            continue; /* a dead connection's generations are cancelled when it is freed */
        if (out_pending(c) > OUT_HIGH_WATER) {
            E.c_stalled++; /* the reader is not keeping up: hold this token back 1 ms */
            heap_push(g, now + 1000000);
            continue;
        }
        if (now - g->due > late_after)
            E.c_late++;
        token_chunk(g);
        touch(c);
        E.c_chunks_sent++;
        g->i++;
        if (g->i >= g->total) {
            E.c_finished++;
            if (c->chat) {
                buf_t *s = &E.scratch;
                s->len = 0;
                sse_open(s);
                buf_add(s, c->pre.p, c->pre.len);
                buf_addf(s, "%d,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"%s\"}]}",
                         g->index, g->total == g->limit ? "length" : "stop");
                sse_close(s);
                buf_t fin = {0};
                put_chunk(&fin, s->p, s->len);
                E.c_chunks_sent++;
                end_gen(g, &fin);
                buf_free(&fin);
            } else {
                end_gen(g, NULL);
            }
        } else {
            int64_t next = g->due + E.itl;
            heap_push(g, E.itl ? (next > now ? next : now) : now);
        }
    }
}

static void arm_timer(int64_t due)
{
    if (due == E.armed)
        return;
    struct itimerspec its = {0};
    if (due > 0) {
        its.it_value.tv_sec = due / 1000000000LL;
        its.it_value.tv_nsec = due % 1000000000LL;
    }
    timerfd_settime(E.tfd, TFD_TIMER_ABSTIME, &its, NULL);
    E.armed = due;
}

static void after_events(void)
{
    for (int k = 0; k < E.nready; k++) {
        econn_t *c = E.ready[k];
        c->queued_ready = 0;
        if (!c->dead)
            process_input(c);
    }
    E.nready = 0;
    for (int k = 0; k < E.ntouched; k++) {
        econn_t *c = E.touched[k];
        c->touched = 0;
        flush(c, 0);
    }
    E.ntouched = 0;
    for (int k = 0; k < E.nclosing; k++)
        conn_free(E.closing[k]);
    E.nclosing = 0;
}

static int engine_main(int argc, char **argv)
{
    int port = 0;
    double ttft_ms = 0, itl_ms = 0, batch_us = 200;
    E.tokens = 200;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--incremental")) {
            E.incremental = 1;
            continue;
        }
        if (!v)
            die("engine: %s needs a value", a);
        if (!strcmp(a, "--port"))
            port = atoi(v);
        else if (!strcmp(a, "--ttft-ms"))
            ttft_ms = atof(v);
        else if (!strcmp(a, "--itl-ms"))
            itl_ms = atof(v);
        else if (!strcmp(a, "--batch-us"))
            batch_us = atof(v);
        else if (!strcmp(a, "--tokens"))
            E.tokens = atoi(v);
        else
            die("engine: unknown option %s", a);
        i++;
    }
    if (E.tokens < 1 || ttft_ms < 0 || itl_ms < 0 || batch_us < 0 || port < 0 || port > 65535)
        die("engine: bad arguments");
    E.ttft = (int64_t)llround(ttft_ms * 1e6);
    E.itl = (int64_t)llround(itl_ms * 1e6);
    E.batch = (int64_t)llround(batch_us * 1e3);
    rng_seed((uint64_t)now_ns() ^ (uint64_t)getpid());

    E.lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (E.lfd < 0)
        die("socket: %s", strerror(errno));
    int one = 1;
    setsockopt(E.lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(E.lfd, (struct sockaddr *)&sa, sizeof sa) < 0)
        die("bind 127.0.0.1:%d: %s", port, strerror(errno));
    if (listen(E.lfd, 4096) < 0)
        die("listen: %s", strerror(errno));
    socklen_t sl = sizeof sa;
    getsockname(E.lfd, (struct sockaddr *)&sa, &sl);
    E.ep = epoll_create1(EPOLL_CLOEXEC);
    E.tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (E.ep < 0 || E.tfd < 0)
        die("epoll/timerfd: %s", strerror(errno));
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &tag_listen};
    epoll_ctl(E.ep, EPOLL_CTL_ADD, E.lfd, &ev);
    ev.data.ptr = &tag_timer;
    epoll_ctl(E.ep, EPOLL_CTL_ADD, E.tfd, &ev);
    printf("native fake engine listening on http://127.0.0.1:%d\n", ntohs(sa.sin_port));
    fflush(stdout);

    struct epoll_event evs[512];
    for (;;) {
        int timeout = -1;
        if (E.hn) {
            int64_t due = E.heap[0]->due;
            if (due <= now_ns() + E.batch)
                timeout = 0;
            else
                arm_timer(due);
        }
        int n = epoll_wait(E.ep, evs, 512, timeout);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait: %s", strerror(errno));
        }
        for (int k = 0; k < n; k++) {
            void *t = evs[k].data.ptr;
            if (t == &tag_listen) {
                do_accept();
            } else if (t == &tag_timer) {
                uint64_t x;
                if (read(E.tfd, &x, sizeof x) < 0 && errno != EAGAIN)
                    die("timerfd read: %s", strerror(errno));
                E.armed = 0;
            } else {
                econn_t *c = t;
                if (c->dead)
                    continue;
                if (evs[k].events & EPOLLOUT)
                    flush(c, 1);
                if (evs[k].events & (EPOLLIN | EPOLLERR | EPOLLHUP))
                    conn_read(c);
            }
        }
        clock_pass();
        after_events();
    }
    return 0;
}

/* ==== load mode ============================================================================ */

enum { C_WAIT, C_CONNECTING, C_SENDING, C_HEAD, C_BODY, C_STOPPED };
enum { B_CHUNKED, B_LENGTH, B_CLOSE };
enum { D_SIZE, D_EXT, D_SIZE_LF, D_DATA, D_DATA_CR, D_DATA_LF, D_TRAILER, D_TRAILER_LINE,
       D_END_LF, D_DONE };

typedef struct client {
    int fd;
    int state;
    uint32_t events;
    int64_t start_at; /* ramp */
    int64_t t0, deadline;
    buf_t req;
    size_t reqoff;
    buf_t head;
    int bmode, keep;
    int64_t clen_left;
    int dstate;
    uint64_t dsize;
    int ddigits;
    buf_t sse;
    int64_t *last;
    unsigned char *seen;
    int firsts, first_seen, all_seen;
    int done; /* [DONE] seen */
    int content_events;
    int leave_after; /* -1: stay to the end */
    const char *err;
} client_t;

typedef struct {
    uint32_t *v;
    size_t n, cap;
} samples_t;

static void samples_add(samples_t *s, int64_t ns)
{
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 65536;
        s->v = xrealloc(s->v, s->cap * sizeof *s->v);
    }
    int64_t us = (ns + 500) / 1000;
    s->v[s->n++] = us < 0 ? 0 : us > 0xFFFFFFFFLL ? 0xFFFFFFFFu : (uint32_t)us;
}

#define MAX_KINDS 32

static struct {
    /* config */
    char host[64];
    int port;
    char *path;
    buf_t headers; /* "Name: value\r\n"... */
    buf_t model;   /* raw JSON string contents */
    int n, tokens, concurrency, progress;
    double ramp, request_timeout, disconnect_fraction;
    int disconnect_after;
    int64_t start, ws, we, stop_at;
    double duration;
    /* state */
    int ep;
    client_t *cl;
    struct sockaddr_in addr;
    uint64_t seq;
    int stopping;
    /* stats */
    uint64_t window_chunks, window_content, total_chunks, started, completed, window_completed,
        window_started, disconnects, window_disconnects, window_errors;
    int inflight, inflight_at_stop, stop_recorded;
    const char *kinds[MAX_KINDS];
    uint64_t kind_n[MAX_KINDS];
    int nkinds;
    samples_t ttft, gaps, all_first;
    double inflight_sum;
    int inflight_samples;
} L;

static int in_window(int64_t t) { return L.ws <= t && t <= L.we; }

static void count_error(const char *kind, int64_t now)
{
    int k;
    for (k = 0; k < L.nkinds; k++)
        if (!strcmp(L.kinds[k], kind))
            break;
    if (k == L.nkinds) {
        if (L.nkinds == MAX_KINDS)
            k = MAX_KINDS - 1; /* unreachable with the fixed set of kinds below */
        else
            L.kinds[L.nkinds++] = kind;
    }
    L.kind_n[k]++;
    if (in_window(now))
        L.window_errors++;
}

static void client_events(client_t *c, uint32_t ev)
{
    if (c->events == ev || c->fd < 0)
        return;
    struct epoll_event e = {.events = ev, .data.ptr = c};
    if (epoll_ctl(L.ep, EPOLL_CTL_MOD, c->fd, &e) == 0)
        c->events = ev;
}

static void client_close(client_t *c)
{
    if (c->fd >= 0) {
        epoll_ctl(L.ep, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        c->fd = -1;
        c->events = 0;
    }
}

static void build_request(client_t *c)
{
    buf_t body = {0};
    L.seq++;
    buf_adds(&body, "{\"model\":\"");
    buf_add(&body, L.model.p, L.model.len);
    buf_addf(&body, "\",\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a long story #%llu.\"}],"
                    "\"stream\":true,\"max_tokens\":%d,\"n\":%d}",
             (unsigned long long)L.seq, L.tokens, L.n);
    c->req.len = 0;
    c->reqoff = 0;
    buf_addf(&c->req, "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                      "Accept: text/event-stream\r\n", L.path, L.host, L.port);
    buf_add(&c->req, L.headers.p, L.headers.len);
    buf_addf(&c->req, "Content-Length: %zu\r\n\r\n", body.len);
    buf_add(&c->req, body.p, body.len);
    buf_free(&body);
}

static void start_request(client_t *c, int64_t now);

/* The request ended: `err` an error kind, or NULL (completed, or left by choice). */
static void end_request(client_t *c, const char *err, int left, int64_t now)
{
    L.inflight--;
    if (err) {
        count_error(err, now);
        client_close(c);
    } else if (left) {
        L.disconnects++;
        if (in_window(now))
            L.window_disconnects++;
        client_close(c);
    } else {
        L.completed++;
        if (in_window(now))
            L.window_completed++;
        if (!c->keep)
            client_close(c);
    }
    if (L.stopping)
        c->state = C_STOPPED;
    else
        start_request(c, now);
}

static void try_send(client_t *c, int64_t now)
{
    int r = send_some(c->fd, c->req.p, c->req.len, &c->reqoff);
    if (r == 1) {
        client_events(c, EPOLLOUT);
        return;
    }
    if (r < 0) {
        end_request(c, "connection", 0, now);
        return;
    }
    c->state = C_HEAD;
    c->head.len = 0;
    client_events(c, EPOLLIN);
}

static void start_request(client_t *c, int64_t now)
{
    c->t0 = now;
    c->deadline = now + (int64_t)(L.request_timeout * 1e9);
    L.started++;
    if (in_window(now))
        L.window_started++;
    L.inflight++;
    c->leave_after = -1;
    if (L.disconnect_after >= 0 && rng_unit() < L.disconnect_fraction)
        c->leave_after = L.disconnect_after;
    c->firsts = c->first_seen = c->all_seen = c->done = c->content_events = 0;
    memset(c->seen, 0, (size_t)L.n);
    c->sse.len = 0;
    c->dstate = D_SIZE;
    c->dsize = 0;
    c->ddigits = 0;
    build_request(c);
    if (c->fd >= 0) {
        c->state = C_SENDING;
        try_send(c, now);
        return;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        end_request(c, "connection", 0, now);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->fd = fd;
    int r = connect(fd, (struct sockaddr *)&L.addr, sizeof L.addr);
    if (r < 0 && errno != EINPROGRESS) {
        /* registered nowhere yet: close directly */
        close(fd);
        c->fd = -1;
        end_request(c, "connection", 0, now);
        return;
    }
    struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
    if (epoll_ctl(L.ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        c->fd = -1;
        end_request(c, "connection", 0, now);
        return;
    }
    c->events = EPOLLOUT;
    if (r == 0) {
        c->state = C_SENDING;
        try_send(c, now);
    } else {
        c->state = C_CONNECTING;
    }
}

/* bench/loadgen.py's `"content": ?"(?!")`: a non-empty content string. */
static int has_content(const char *s, const char *e)
{
    static const char key[] = "\"content\":";
    const char *p = s;
    while ((p = memmem(p, (size_t)(e - p), key, sizeof key - 1))) {
        const char *q = p + sizeof key - 1;
        if (q < e && *q == ' ')
            q++;
        if (q < e && *q == '"' && (q + 1 >= e || q[1] != '"'))
            return 1;
        p++;
    }
    return 0;
}

/* `"index": ?(\d+)`: the first match's number, or -1. */
static long find_index(const char *s, const char *e)
{
    static const char key[] = "\"index\":";
    const char *p = s;
    while ((p = memmem(p, (size_t)(e - p), key, sizeof key - 1))) {
        const char *q = p + sizeof key - 1;
        if (q < e && *q == ' ')
            q++;
        if (q < e && *q >= '0' && *q <= '9') {
            long v = 0;
            while (q < e && *q >= '0' && *q <= '9' && v < 100000000)
                v = v * 10 + (*q++ - '0');
            return v;
        }
        p++;
    }
    return -1;
}

/* One SSE event [s, e) (without its blank line). 0: go on; 1: error; 2: leave now. */
static int on_event(client_t *c, const char *s, const char *e, int64_t now)
{
    size_t n = (size_t)(e - s);
    if ((n >= 12 && memcmp(s, "data: [DONE]", 12) == 0) ||
        (n >= 11 && memcmp(s, "data:[DONE]", 11) == 0)) {
        c->done = 1;
        return 0;
    }
    if (n < 5 || memcmp(s, "data:", 5) != 0)
        return 0;
    L.total_chunks++;
    int inwin = in_window(now);
    if (inwin)
        L.window_chunks++;
    if (!has_content(s, e)) {
        const char *p = s + 5;
        if (p < e && *p == ' ')
            p++;
        if ((size_t)(e - p) >= 8 && memcmp(p, "{\"error\"", 8) == 0) {
            c->err = "error event";
            return 1;
        }
        return 0;
    }
    if (inwin)
        L.window_content++;
    long idx = 0;
    if (L.n > 1) {
        idx = find_index(s, e);
        if (idx < 0 || idx >= L.n)
            idx = 0;
    }
    if (c->seen[idx]) {
        if (inwin && c->last[idx] >= L.ws)
            samples_add(&L.gaps, now - c->last[idx]);
    } else {
        c->seen[idx] = 1;
        int timed = L.ws <= c->t0 && now <= L.we;
        if (!c->first_seen) {
            c->first_seen = 1;
            if (timed)
                samples_add(&L.ttft, now - c->t0);
        }
        if (++c->firsts == L.n) {
            c->all_seen = 1;
            if (timed)
                samples_add(&L.all_first, now - c->t0);
        }
    }
    c->last[idx] = now;
    c->content_events++;
    if (c->leave_after >= 0 && c->content_events >= c->leave_after)
        return 2;
    return 0;
}

/* Decoded body bytes: split into SSE events. */
static int sse_feed(client_t *c, const char *p, size_t n, int64_t now)
{
    const char *s, *e;
    size_t from = 0;
    if (c->sse.len == 0) {
        s = p;
        e = p + n;
    } else {
        from = c->sse.len - 1; /* a "\n\n" may straddle the old and the new bytes */
        buf_add(&c->sse, p, n);
        s = c->sse.p;
        e = s + c->sse.len;
    }
    const char *ev = s;
    const char *scan = s + from;
    const char *nn;
    while ((nn = memmem(scan, (size_t)(e - scan), "\n\n", 2))) {
        int r = on_event(c, ev, nn, now);
        if (r)
            return r;
        ev = scan = nn + 2;
    }
    if (c->sse.len == 0) {
        if (ev < e)
            buf_add(&c->sse, ev, (size_t)(e - ev));
    } else {
        buf_consume(&c->sse, (size_t)(ev - s));
    }
    return 0;
}

/* 0 if the framing byte `ch` is `want`; else 1 with the error `msg`. */
static int expect_byte(client_t *c, char ch, char want, const char *msg)
{
    if (ch == want)
        return 0;
    c->err = msg;
    return 1;
}

/* Body bytes as received. 0: more to come; 1: error (c->err); 2: leave; 3: body complete. */
static int body_feed(client_t *c, const char *p, size_t n, int64_t now)
{
    if (c->bmode == B_CLOSE)
        return sse_feed(c, p, n, now);
    if (c->bmode == B_LENGTH) {
        size_t take = (int64_t)n < c->clen_left ? n : (size_t)c->clen_left;
        c->clen_left -= (int64_t)take;
        int r = sse_feed(c, p, take, now);
        if (r)
            return r;
        return c->clen_left == 0 ? 3 : 0;
    }
    const char *e = p + n;
    while (p < e) {
        char ch = *p;
        switch (c->dstate) {
        case D_SIZE: {
            int h = hexval(ch);
            if (h >= 0) {
                if (++c->ddigits > 12) {
                    c->err = "bad chunk size";
                    return 1;
                }
                c->dsize = c->dsize * 16 + (uint64_t)h;
                p++;
            } else if (c->ddigits && (ch == ';' || ch == ' ' || ch == '\t')) {
                c->dstate = D_EXT;
                p++;
            } else if (c->ddigits && ch == '\r') {
                c->dstate = D_SIZE_LF;
                p++;
            } else {
                c->err = "bad chunk size";
                return 1;
            }
            break;
        }
        case D_EXT:
            if (ch == '\r')
                c->dstate = D_SIZE_LF;
            p++;
            break;
        case D_SIZE_LF:
            if (expect_byte(c, ch, '\n', "bad chunk size"))
                return 1;
            p++;
            c->dstate = c->dsize ? D_DATA : D_TRAILER;
            break;
        case D_DATA: {
            size_t take = (size_t)(e - p) < c->dsize ? (size_t)(e - p) : (size_t)c->dsize;
            c->dsize -= take;
            int r = sse_feed(c, p, take, now);
            if (r)
                return r;
            p += take;
            if (c->dsize == 0)
                c->dstate = D_DATA_CR;
            break;
        }
        case D_DATA_CR:
        case D_DATA_LF:
            if (expect_byte(c, ch, c->dstate == D_DATA_CR ? '\r' : '\n', "bad chunk framing"))
                return 1;
            p++;
            if (c->dstate == D_DATA_CR) {
                c->dstate = D_DATA_LF;
            } else {
                c->dstate = D_SIZE;
                c->dsize = 0;
                c->ddigits = 0;
            }
            break;
        case D_TRAILER: /* at the start of a trailer line */
            c->dstate = ch == '\r' ? D_END_LF : D_TRAILER_LINE;
            p++;
            break;
        case D_TRAILER_LINE:
            if (ch == '\n')
                c->dstate = D_TRAILER;
            p++;
            break;
        case D_END_LF:
            if (expect_byte(c, ch, '\n', "bad chunk framing"))
                return 1;
            c->dstate = D_DONE;
            return 3; /* bytes after the body (none expected) are dropped */
        default:
            return 3;
        }
    }
    return 0;
}

/* Parse the response head in c->head; feed what follows it. Same return codes as body_feed,
 * plus -1: head incomplete. */
static int on_head(client_t *c, int64_t now)
{
    char *s = c->head.p;
    char *he = memmem(s, c->head.len, "\r\n\r\n", 4);
    if (!he) {
        if (c->head.len > 65536) {
            c->err = "response head too large";
            return 1;
        }
        return -1;
    }
    char *le = memmem(s, (size_t)(he + 2 - s), "\r\n", 2);
    char *sp = memchr(s, ' ', (size_t)(le - s));
    int status = sp ? atoi(sp + 1) : 0;
    int chunked = 0, have_len = 0;
    int64_t clen = 0;
    c->keep = 1;
    for (char *ls = le + 2; ls < he;) {
        char *nl = memmem(ls, (size_t)(he + 2 - ls), "\r\n", 2);
        const char *v, *ve;
        if (header_is(ls, nl, "transfer-encoding", &v, &ve) && contains_ci(v, ve, "chunked")) {
            chunked = 1;
        } else if (header_is(ls, nl, "content-length", &v, &ve)) {
            have_len = 1;
            clen = strtoll(v, NULL, 10);
        } else if (header_is(ls, nl, "connection", &v, &ve) && (size_t)(ve - v) == 5 &&
                   strncasecmp(v, "close", 5) == 0) {
            c->keep = 0;
        }
        ls = nl + 2;
    }
    if (status != 200) {
        static char kinds[8][16];
        static int nk;
        char kind[16];
        snprintf(kind, sizeof kind, "http_%d", status);
        int k;
        for (k = 0; k < nk; k++)
            if (!strcmp(kinds[k], kind))
                break;
        if (k == nk) {
            if (nk == 8)
                k = 7;
            else
                nk++;
            snprintf(kinds[k], sizeof kinds[k], "%s", kind);
        }
        c->err = kinds[k];
        return 1;
    }
    c->bmode = chunked ? B_CHUNKED : have_len ? B_LENGTH : B_CLOSE;
    c->clen_left = clen;
    c->state = C_BODY;
    size_t hl = (size_t)(he + 4 - s);
    size_t rest = c->head.len - hl;
    if (c->bmode == B_LENGTH && clen == 0)
        return 3;
    return rest ? body_feed(c, s + hl, rest, now) : 0;
}

static void finish_body(client_t *c, int64_t now)
{
    end_request(c, c->done ? NULL : "stream ended without [DONE]", 0, now);
}

static void handle_result(client_t *c, int r, int64_t now)
{
    if (r == 1)
        end_request(c, c->err, 0, now);
    else if (r == 2)
        end_request(c, NULL, 1, now);
    else if (r == 3)
        finish_body(c, now);
}

static char rbuf[65536];

static void client_readable(client_t *c)
{
    for (int rounds = 0; rounds < 8 && (c->state == C_HEAD || c->state == C_BODY); rounds++) {
        ssize_t n = recv(c->fd, rbuf, sizeof rbuf, MSG_DONTWAIT);
        int64_t now = now_ns();
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            end_request(c, "connection", 0, now);
            return;
        }
        if (n == 0) {
            if (c->state == C_HEAD)
                end_request(c, "closed before the response head", 0, now);
            else if (c->bmode == B_CLOSE) {
                c->keep = 0;
                finish_body(c, now);
            } else
                end_request(c, "connection closed mid-body", 0, now);
            return;
        }
        int r;
        if (c->state == C_HEAD) {
            buf_add(&c->head, rbuf, (size_t)n);
            r = on_head(c, now);
            if (r < 0)
                continue;
        } else {
            r = body_feed(c, rbuf, (size_t)n, now);
        }
        if (r) {
            handle_result(c, r, now);
            return;
        }
        if ((size_t)n < sizeof rbuf)
            return;
    }
}

static void client_event(client_t *c, uint32_t ev)
{
    int64_t now = now_ns();
    if (c->state == C_CONNECTING) {
        int err = 0;
        socklen_t sl = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl);
        if (err || (ev & (EPOLLERR | EPOLLHUP))) {
            end_request(c, "connection", 0, now);
            return;
        }
        c->state = C_SENDING;
        try_send(c, now);
        return;
    }
    if (c->state == C_SENDING) {
        if (ev & (EPOLLERR | EPOLLHUP)) {
            end_request(c, "connection", 0, now);
            return;
        }
        try_send(c, now);
        return;
    }
    if (c->state == C_HEAD || c->state == C_BODY)
        client_readable(c);
}

/* -- results -- */
static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* bench.loadgen.pct (nearest rank) on µs samples, and up to k random samples, in ms. */
static void put_pct(buf_t *o, const char *name, samples_t *s, const char *sname, size_t k)
{
    buf_addf(o, ",\"%s\":", sname);
    size_t n = s->n;
    /* a random subset first (partial Fisher-Yates), then sort everything for the ranks */
    size_t m = n < k ? n : k;
    for (size_t i = 0; i < m; i++) {
        size_t j = i + (size_t)(rng_next() % (n - i));
        uint32_t t = s->v[i];
        s->v[i] = s->v[j];
        s->v[j] = t;
    }
    buf_add(o, "[", 1);
    for (size_t i = 0; i < m; i++)
        buf_addf(o, i ? ",%.3f" : "%.3f", s->v[i] / 1000.0);
    buf_add(o, "]", 1);
    buf_addf(o, ",\"%s\":", name);
    if (!n) {
        buf_adds(o, "{\"count\":0}");
        return;
    }
    qsort(s->v, n, sizeof *s->v, cmp_u32);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += s->v[i];
    static const double qs[] = {50, 90, 99, 99.9};
    static const char *qn[] = {"p50", "p90", "p99", "p999"};
    buf_addf(o, "{\"count\":%zu,\"mean\":%.6f", n, sum / (double)n / 1000.0);
    for (int i = 0; i < 4; i++) {
        double r = ceil(qs[i] / 100 * (double)n) - 1;
        size_t idx = r < 0 ? 0 : (size_t)r >= n ? n - 1 : (size_t)r;
        buf_addf(o, ",\"%s\":%.3f", qn[i], s->v[idx] / 1000.0);
    }
    buf_addf(o, ",\"max\":%.3f}", s->v[n - 1] / 1000.0);
}

static void print_results(void)
{
    buf_t o = {0};
    buf_addf(&o, "{\"window_s\":%.6f,\"chunks\":%llu,\"content_chunks\":%llu,\"total_chunks\":%llu,"
                 "\"requests_started\":%llu,\"requests_completed\":%llu,\"window_started\":%llu,"
                 "\"window_completed\":%llu,\"disconnects\":%llu,\"window_disconnects\":%llu,"
                 "\"window_errors\":%llu,\"inflight_at_stop\":%d,\"mean_inflight\":%.3f,"
                 "\"errors\":{",
             (double)(L.we - L.ws) / 1e9, (unsigned long long)L.window_chunks,
             (unsigned long long)L.window_content, (unsigned long long)L.total_chunks,
             (unsigned long long)L.started, (unsigned long long)L.completed,
             (unsigned long long)L.window_started, (unsigned long long)L.window_completed,
             (unsigned long long)L.disconnects, (unsigned long long)L.window_disconnects,
             (unsigned long long)L.window_errors, L.inflight_at_stop,
             L.inflight_samples ? L.inflight_sum / L.inflight_samples : 0.0);
    for (int k = 0; k < L.nkinds; k++)
        buf_addf(&o, "%s\"%s\":%llu", k ? "," : "", L.kinds[k], (unsigned long long)L.kind_n[k]);
    buf_add(&o, "}", 1);
    put_pct(&o, "ttft_ms", &L.ttft, "ttft_samples", 2000);
    put_pct(&o, "gap_ms", &L.gaps, "gap_samples", 4000);
    put_pct(&o, "all_first_ms", &L.all_first, "all_first_samples", 2000);
    buf_adds(&o, "}\n");
    if (write_all(1, o.p, o.len) < 0)
        die("write results: %s", strerror(errno));
    buf_free(&o);
}

static int64_t abs_s(double s) { return (int64_t)llround(s * 1e9); }

static void load_config(const char *js)
{
    const char *e = js + strlen(js), *vs, *ve;
    double d;
    buf_t tmp = {0};
    if (!jobject_ok(js, e))
        die("load: the config is not a JSON object");
#define NUM(key, dst, dflt) (dst) = (jget(js, e, key, &vs, &ve) && jnum(vs, ve, &d)) ? d : (dflt)
    snprintf(L.host, sizeof L.host, "127.0.0.1");
    if (jget(js, e, "host", &vs, &ve) && jstr_decode(vs, ve, &tmp))
        snprintf(L.host, sizeof L.host, "%s", tmp.p);
    double port, n, fanout, tokens, conc, da;
    NUM("port", port, -1);
    NUM("n", n, 1);
    NUM("fanout", fanout, 1);
    NUM("tokens", tokens, 200);
    NUM("concurrency", conc, 1);
    NUM("ramp", L.ramp, 0);
    NUM("request_timeout", L.request_timeout, 60);
    NUM("disconnect_fraction", L.disconnect_fraction, 1.0);
    NUM("disconnect_after", da, -1);
    double ws, we, start, linger;
    NUM("window_start", ws, -1);
    NUM("window_end", we, -1);
    NUM("start", start, -1);
    NUM("linger", linger, 0.25);
    NUM("seed", d, 1);
    rng_seed((uint64_t)d);
#undef NUM
    if (port <= 0 || port > 65535)
        die("load: config needs a port");
    if (ws < 0 || we < ws || start < 0)
        die("load: config needs start <= window_start <= window_end (monotonic seconds)");
    if (fanout != 1)
        die("load: fanout > 1 is not implemented (use the Python load generator)");
    if (jget(js, e, "rate", &vs, &ve) && !jis(vs, ve, "null") && !jis(vs, ve, "0") &&
        !jis(vs, ve, "false"))
        die("load: the open loop (rate) is not implemented (use the Python load generator)");
    if (jget(js, e, "think", &vs, &ve) && !jis(vs, ve, "null") && !jis(vs, ve, "0"))
        die("load: think time is not implemented (use the Python load generator)");
    L.port = (int)port;
    L.n = n < 1 ? 1 : (int)n;
    L.tokens = (int)tokens;
    L.concurrency = conc < 1 ? 1 : (int)conc;
    L.disconnect_after = da < 0 ? -1 : (int)da;
    L.progress = !(jget(js, e, "progress", &vs, &ve) && jis(vs, ve, "false"));
    L.start = abs_s(start);
    L.ws = abs_s(ws);
    L.we = abs_s(we);
    L.stop_at = L.we + abs_s(linger);
    L.duration = we - ws;
    if (!(jget(js, e, "path", &vs, &ve) && jstr_decode(vs, ve, &tmp)))
        die("load: config needs a path");
    L.path = strdup(tmp.p);
    const char *ms;
    size_t mn;
    if (jget(js, e, "model", &vs, &ve) && jstr_raw(vs, ve, &ms, &mn))
        buf_add(&L.model, ms, mn);
    else
        buf_adds(&L.model, "bench-model");
    if (jget(js, e, "headers", &vs, &ve) && *vs == '{') {
        const char *p = jws(vs + 1, ve);
        while (p < ve && *p == '"') {
            const char *kend = jstr_end(p, ve);
            buf_t key = {0};
            if (!kend || !jstr_decode(p, kend, &key))
                die("load: bad headers");
            p = jws(kend, ve);
            if (*p != ':')
                die("load: bad headers");
            const char *v = jws(p + 1, ve), *vend = jskip(v, ve, 1);
            if (!vend || !jstr_decode(v, vend, &tmp))
                die("load: header values must be strings");
            if (strpbrk(key.p, "\r\n:") || strpbrk(tmp.p, "\r\n"))
                die("load: bad header");
            buf_addf(&L.headers, "%s: %s\r\n", key.p, tmp.p);
            buf_free(&key);
            p = jws(vend, ve);
            if (*p == ',')
                p = jws(p + 1, ve);
        }
    }
    buf_free(&tmp);
    L.addr.sin_family = AF_INET;
    L.addr.sin_port = htons((uint16_t)L.port);
    if (inet_pton(AF_INET, L.host, &L.addr.sin_addr) != 1)
        die("load: host must be an IPv4 address, got %s", L.host);
}

static void progress_line(int64_t now)
{
    uint64_t errs = 0;
    for (int k = 0; k < L.nkinds; k++)
        errs += L.kind_n[k];
    fprintf(stderr, "PROGRESS {\"t\": %.1f, \"of\": %g, \"chunks\": %llu, \"inflight\": %d, "
                    "\"errors\": %llu}\n",
            (double)(now - L.ws) / 1e9, L.duration, (unsigned long long)L.window_chunks,
            L.inflight, (unsigned long long)errs);
    fflush(stderr);
}

static int load_main(int argc, char **argv)
{
    if (argc < 1)
        die("load: usage: harness load '<json config>'");
    load_config(argv[0]);
    L.ep = epoll_create1(EPOLL_CLOEXEC);
    if (L.ep < 0)
        die("epoll_create1: %s", strerror(errno));
    L.cl = xcalloc((size_t)L.concurrency, sizeof *L.cl);
    for (int i = 0; i < L.concurrency; i++) {
        client_t *c = &L.cl[i];
        c->fd = -1;
        c->state = C_WAIT;
        c->start_at = L.start + (int64_t)(L.ramp * 1e9 * i / L.concurrency);
        c->last = xcalloc((size_t)L.n, sizeof *c->last);
        c->seen = xcalloc((size_t)L.n, 1);
    }
    int next_start = 0;
    int64_t next_progress = L.ws + 1000000000LL;
    int64_t next_sample = L.ws + 500000000LL;
    int64_t next_sweep = now_ns() + 100000000LL;
    struct epoll_event evs[512];
    for (;;) {
        int64_t now = now_ns();
        while (next_start < L.concurrency && L.cl[next_start].start_at <= now && !L.stopping)
            start_request(&L.cl[next_start++], now);
        if (!L.stop_recorded && now >= L.we) {
            L.stop_recorded = 1;
            L.inflight_at_stop = L.inflight;
        }
        if (now >= next_sample && next_sample <= L.we) {
            L.inflight_sum += L.inflight;
            L.inflight_samples++;
            next_sample += 500000000LL;
        }
        if (now >= next_progress && next_progress <= L.we + 500000000LL) {
            if (L.progress)
                progress_line(now);
            next_progress += 1000000000LL;
            if (next_progress > L.we && next_progress < L.we + 1000000000LL)
                next_progress = L.we;
        }
        if (now >= next_sweep) {
            for (int i = 0; i < L.concurrency; i++) {
                client_t *c = &L.cl[i];
                if (c->state != C_WAIT && c->state != C_STOPPED && now > c->deadline)
                    end_request(c, "timeout", 0, now);
            }
            next_sweep = now + 100000000LL;
        }
        if (now >= L.stop_at)
            break;
        int64_t wake = L.stop_at;
        if (next_start < L.concurrency && L.cl[next_start].start_at < wake)
            wake = L.cl[next_start].start_at;
        if (next_progress < wake && next_progress <= L.we + 500000000LL)
            wake = next_progress;
        if (next_sample < wake && next_sample <= L.we)
            wake = next_sample;
        if (next_sweep < wake)
            wake = next_sweep;
        int64_t dt = wake - now;
        int timeout = dt <= 0 ? 0 : (int)((dt + 999999) / 1000000);
        int n = epoll_wait(L.ep, evs, 512, timeout);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait: %s", strerror(errno));
        }
        for (int k = 0; k < n; k++)
            client_event(evs[k].data.ptr, evs[k].events);
    }
    L.stopping = 1;
    for (int i = 0; i < L.concurrency; i++)
        client_close(&L.cl[i]);
    print_results();
    return 0;
}

/* ==== spin mode ============================================================================ */

/* A CPU-bound loop: table lookups and integer work in a 256 KiB working set (L2-resident), a
 * stand-in for an interpreter's mix of loads, branches and arithmetic. */
static int spin_main(int argc, char **argv)
{
    double secs = argc > 0 ? atof(argv[0]) : 2.0;
    if (secs <= 0)
        die("spin: usage: harness spin SECONDS");
    enum { N = 1 << 16 };
    uint32_t *t = xcalloc(N, sizeof *t);
    for (uint32_t i = 0; i < N; i++)
        t[i] = i * 2654435761u;
    int64_t t0 = now_ns(), end = t0 + (int64_t)(secs * 1e9), now = t0;
    uint64_t it = 0;
    uint32_t x = 1;
    do {
        for (int k = 0; k < 4096; k++) {
            x = x * 1664525u + 1013904223u;
            uint32_t j = (x >> 7) & (N - 1);
            uint32_t v = t[j];
            if (v & 1)
                x ^= v >> 3;
            else
                x += v << 1;
            t[j] = v + x;
        }
        it += 4096;
        now = now_ns();
    } while (now < end);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    printf("{\"iterations\":%llu,\"seconds\":%.6f,\"cpu_s\":%.6f,\"check\":%u}\n",
           (unsigned long long)it, (double)(now - t0) / 1e9, cpu, x & 0xFF);
    free(t);
    return 0;
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    crc_init();
    words_init();
    set_nofile();
    if (argc >= 2 && !strcmp(argv[1], "engine"))
        return engine_main(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "load"))
        return load_main(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "spin"))
        return spin_main(argc - 2, argv + 2);
    fprintf(stderr, "usage: %s engine [--port P] [--ttft-ms X] [--itl-ms X] [--tokens N] "
                    "[--incremental] [--batch-us U]\n       %s load '<json config>'\n       %s spin SECONDS\n",
            argv[0], argv[0], argv[0]);
    return 2;
}
