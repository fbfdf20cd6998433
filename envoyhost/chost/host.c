// envoyhost: a host for bin/llm-filter.so that behaves like Envoy v1.36.2's
// golang HTTP filter (contrib/golang/filters/http/source in the pinned
// github.com/envoyproxy/envoy module). It dlopens the real library with
// RTLD_NOW, defines every C function the library imports (api.h of the same
// module) and drives the exported envoyGo* entry points exactly where Envoy's
// golang_filter.cc / processor_state.cc / cgo.cc would.
//
// The HTTP side (listener, router, clusters, upstream connections) lives in
// the Go driver (envoyhost/driver.go); the two talk over stdin/stdout with the
// frames of envoyhost/frames.go (docs/envoy-filter.md). Logs go to stderr.
//
// References "gf.cc:N" are golang_filter.cc, "ps.cc:N"/"ps.h:N"
// processor_state.{cc,h}, "cgo.cc:N" cgo.cc, all under
// contrib/golang/filters/http/source of envoy v1.36.2; "shim.go"/"config.go"
// are the Go side under its go/pkg/http.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api.h"

// GoString as cgo lays it out (_GoString_ of the Go side).
typedef struct {
  const char *p;
  ptrdiff_t n;
} GoString;

// ---------------------------------------------------------------- utilities

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "envoyhost: fatal: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  abort();
}

static void *xmalloc(size_t n) {
  void *p = calloc(1, n ? n : 1);
  if (!p) die("out of memory");
  return p;
}

static char *xstrndup(const char *s, size_t n) {
  char *p = xmalloc(n + 1);
  if (n) memcpy(p, s, n);
  return p;
}

static uint64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

typedef struct {
  char *p;
  size_t len, cap;
} buf_t;

static void buf_add(buf_t *b, const void *d, size_t n) {
  if (b->len + n > b->cap) {
    size_t c = b->cap ? b->cap * 2 : 256;
    while (c < b->len + n) c *= 2;
    b->p = realloc(b->p, c);
    if (!b->p) die("out of memory");
    b->cap = c;
  }
  if (n) memcpy(b->p + b->len, d, n);
  b->len += n;
}
static void buf_prepend(buf_t *b, const void *d, size_t n) {
  buf_add(b, d, n); // grow
  memmove(b->p + n, b->p, b->len - n);
  memcpy(b->p, d, n);
}
static void buf_drain(buf_t *b, size_t n) {
  if (n >= b->len) {
    b->len = 0;
    return;
  }
  memmove(b->p, b->p + n, b->len - n);
  b->len -= n;
}
static void buf_move(buf_t *dst, buf_t *src) {
  buf_add(dst, src->p, src->len);
  src->len = 0;
}
static void buf_free(buf_t *b) {
  free(b->p);
  b->p = NULL;
  b->len = b->cap = 0;
}

// Header maps keep insertion order and lower-case keys (Http::HeaderMap).
typedef struct {
  char *k, *v;
  size_t kl, vl;
} hdr_t;
typedef struct {
  hdr_t *a;
  int n, cap;
} hmap_t;

static void h_add(hmap_t *m, const char *k, size_t kl, const char *v, size_t vl) {
  if (m->n == m->cap) {
    m->cap = m->cap ? m->cap * 2 : 16;
    m->a = realloc(m->a, sizeof(hdr_t) * m->cap);
    if (!m->a) die("out of memory");
  }
  hdr_t *h = &m->a[m->n++];
  h->k = xstrndup(k, kl);
  for (size_t i = 0; i < kl; i++)
    if (h->k[i] >= 'A' && h->k[i] <= 'Z') h->k[i] += 32;
  h->kl = kl;
  h->v = xstrndup(v, vl);
  h->vl = vl;
}
static void h_remove(hmap_t *m, const char *k, size_t kl) {
  int j = 0;
  for (int i = 0; i < m->n; i++) {
    if (m->a[i].kl == kl && strncasecmp(m->a[i].k, k, kl) == 0) {
      free(m->a[i].k);
      free(m->a[i].v);
      continue;
    }
    m->a[j++] = m->a[i];
  }
  m->n = j;
}
static void h_set(hmap_t *m, const char *k, size_t kl, const char *v, size_t vl) {
  h_remove(m, k, kl);
  h_add(m, k, kl, v, vl);
}
static hdr_t *h_get(hmap_t *m, const char *k) {
  size_t kl = strlen(k);
  for (int i = 0; i < m->n; i++)
    if (m->a[i].kl == kl && strncasecmp(m->a[i].k, k, kl) == 0) return &m->a[i];
  return NULL;
}
static uint64_t h_bytes(hmap_t *m) {
  uint64_t n = 0;
  for (int i = 0; i < m->n; i++) n += m->a[i].kl + m->a[i].vl;
  return n;
}
static void h_free(hmap_t *m) {
  for (int i = 0; i < m->n; i++) {
    free(m->a[i].k);
    free(m->a[i].v);
  }
  free(m->a);
  m->a = NULL;
  m->n = m->cap = 0;
}

// ---------------------------------------------------------------- frames
// [u32 len of rest][u8 type][u64 id][payload]; strings are [u32 len][bytes].

enum {
  // driver -> host
  F_CFG_PUSH = 1,
  F_ROUTE_CFG = 2,
  F_REQ_HEADERS = 3,
  F_REQ_DATA = 4,
  F_REQ_TRAILERS = 5,
  F_RESP_HEADERS = 6,
  F_RESP_DATA = 7,
  F_RESP_TRAILERS = 8,
  F_RESET = 9,
  F_METRICS = 10,
  F_SHUTDOWN = 11,
  F_CFG_DROP = 12,
  F_GC = 13,
  F_LOCAL_REPLY_CFG = 14,
  // host -> driver
  F_FWD_HEADERS = 51,
  F_FWD_DATA = 52,
  F_FWD_TRAILERS = 53,
  F_CLIENT_HEADERS = 54,
  F_CLIENT_DATA = 55,
  F_CLIENT_TRAILERS = 56,
  F_STREAM_END = 57,
  F_UPSTREAM_CANCEL = 58,
  F_CFG_PUSHED = 101,
  F_ROUTE_SET = 102,
  F_CFG_DESTROYED = 103,
  F_METRICS_OUT = 110,
  F_BYE = 111,
  F_GC_DONE = 112,
  F_LOCAL_REPLY_SET = 113,
};

static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;

static void put_u32(buf_t *b, uint32_t v) { buf_add(b, &v, 4); }
static void put_u64(buf_t *b, uint64_t v) { buf_add(b, &v, 8); }
static void put_u8(buf_t *b, uint8_t v) { buf_add(b, &v, 1); }
static void put_str(buf_t *b, const char *s, size_t n) {
  put_u32(b, (uint32_t)n);
  buf_add(b, s, n);
}
static void put_hmap(buf_t *b, hmap_t *m) {
  put_u32(b, (uint32_t)(m ? m->n : 0));
  for (int i = 0; m && i < m->n; i++) {
    put_str(b, m->a[i].k, m->a[i].kl);
    put_str(b, m->a[i].v, m->a[i].vl);
  }
}

static int frame_fd = 1; // the driver pipe (main moves it off fd 1)

static void send_frame(uint8_t type, uint64_t id, buf_t *payload) {
  buf_t f = {0};
  put_u32(&f, (uint32_t)(1 + 8 + (payload ? payload->len : 0)));
  put_u8(&f, type);
  put_u64(&f, id);
  if (payload) buf_add(&f, payload->p, payload->len);
  pthread_mutex_lock(&out_mu);
  size_t off = 0;
  while (off < f.len) {
    ssize_t w = write(frame_fd, f.p + off, f.len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      pthread_mutex_unlock(&out_mu);
      fprintf(stderr, "envoyhost: driver pipe closed, exiting\n");
      _exit(0);
    }
    off += (size_t)w;
  }
  pthread_mutex_unlock(&out_mu);
  buf_free(&f);
}

typedef struct {
  const char *p;
  size_t len, off;
} rd_t;
static uint32_t get_u32(rd_t *r) {
  uint32_t v = 0;
  if (r->off + 4 > r->len) die("short frame");
  memcpy(&v, r->p + r->off, 4);
  r->off += 4;
  return v;
}
static uint8_t get_u8(rd_t *r) {
  if (r->off + 1 > r->len) die("short frame");
  return (uint8_t)r->p[r->off++];
}
static const char *get_str(rd_t *r, size_t *n) {
  *n = get_u32(r);
  if (r->off + *n > r->len) die("short frame");
  const char *s = r->p + r->off;
  r->off += *n;
  return s;
}
static void get_hmap(rd_t *r, hmap_t *m) {
  uint32_t n = get_u32(r);
  for (uint32_t i = 0; i < n; i++) {
    size_t kl, vl;
    const char *k = get_str(r, &kl);
    const char *v = get_str(r, &vl);
    h_add(m, k, kl, v, vl);
  }
}

// ---------------------------------------------------------------- the library

typedef uint64_t (*new_cfg_fn)(httpConfig *);
typedef uint64_t (*merge_cfg_fn)(uint64_t, uint64_t, uint64_t, uint64_t);
typedef void (*destroy_cfg_fn)(uint64_t, int);
typedef uint64_t (*on_header_fn)(processState *, uint64_t, uint64_t, uint64_t);
typedef uint64_t (*on_data_fn)(processState *, uint64_t, uint64_t, uint64_t);
typedef void (*on_log_fn)(httpRequest *, uint64_t, processState *, processState *, uint64_t,
                          uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
typedef void (*on_req_fn)(httpRequest *);
typedef void (*on_destroy_fn)(httpRequest *, uint64_t);

static struct {
  new_cfg_fn new_cfg;
  merge_cfg_fn merge_cfg;
  destroy_cfg_fn destroy_cfg;
  on_header_fn on_header;
  on_data_fn on_data;
  on_log_fn on_log;
  on_req_fn on_stream_complete;
  on_destroy_fn on_destroy;
  on_req_fn sema_dec;
} so;

static const char *plugin_name = "llm-filter";
static uint32_t concurrency = 2;
static uint32_t log_level = 2; // api.Info
static uint64_t decoder_limit = 1 << 20, encoder_limit = 1 << 20; // per_connection_buffer_limit_bytes

// ---------------------------------------------------------------- workers (dispatchers)

typedef struct task {
  void (*fn)(void *);
  void *arg;
  struct task *next;
} task_t;

typedef struct {
  pthread_t tid;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  task_t *head, *tail;
  uint32_t id;
} worker_t;

static worker_t *workers;

// Dispatcher::post: runs fn on the worker's thread, in order.
static void post(worker_t *w, void (*fn)(void *), void *arg) {
  task_t *t = xmalloc(sizeof *t);
  t->fn = fn;
  t->arg = arg;
  pthread_mutex_lock(&w->mu);
  if (w->tail)
    w->tail->next = t;
  else
    w->head = t;
  w->tail = t;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static void *worker_loop(void *arg) {
  worker_t *w = arg;
  for (;;) {
    pthread_mutex_lock(&w->mu);
    while (!w->head) pthread_cond_wait(&w->cv, &w->mu);
    task_t *t = w->head;
    w->head = t->next;
    if (!w->head) w->tail = NULL;
    pthread_mutex_unlock(&w->mu);
    t->fn(t->arg);
    free(t);
  }
  return NULL;
}

static int is_thread(worker_t *w) { return pthread_equal(pthread_self(), w->tid); }

// ---------------------------------------------------------------- configs and metrics

// Stats live in the listener's scope, so a name defined again by the next
// config is the same stat (gf.cc:1612 defineMetric uses the scope).
#define MAX_STATS 1024
static pthread_mutex_t stats_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  char *name;
  int type;
  int64_t value; // histograms: the sum of recorded values
  int64_t count; // histograms: how many were recorded
} stats[MAX_STATS];
static int nstats;

static int stat_index(const char *name, size_t n, int type) {
  for (int i = 0; i < nstats; i++)
    if (strlen(stats[i].name) == n && !memcmp(stats[i].name, name, n)) return i;
  if (nstats == MAX_STATS) die("too many stats");
  stats[nstats].name = xstrndup(name, n);
  stats[nstats].type = type;
  return nstats++;
}

// fconfig_t is FilterConfig (gf.cc:1569); hconfig_t is httpConfigInternal, the
// raw memory Go keeps and frees from its GC finalizer (cgo.cc:323).
typedef struct fconfig fconfig_t;
typedef struct {
  httpConfig base; // must be first: Go sees httpConfig*
  fconfig_t *weak; // NULL once the FilterConfig is gone (weak_ptr expired)
} hconfig_t;

struct fconfig {
  uint64_t id;
  int refs; // guarded by cfg_mu
  hconfig_t *h;
  pthread_mutex_t mu; // FilterConfig::mutex_
  int metric_ids[MAX_STATS];
  int nmetrics;
  char *buf; // serialized plugin_config, alive while Go parses
  size_t buf_len;
};

static pthread_mutex_t cfg_mu = PTHREAD_MUTEX_INITIALIZER; // weak pointers and refcounts
static fconfig_t *current_cfg;

// Route-level config (RoutePluginConfig, gf.cc:1738..1829): one route here.
static pthread_mutex_t route_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  int set;
  uint64_t config_id, merged_id, cached_parent;
  httpConfig cfg;
  char *buf;
  size_t buf_len;
} route;

static void report_destroyed(uint64_t id, uint64_t us, int on_worker, int delayed) {
  buf_t p = {0};
  put_u64(&p, us);
  put_u8(&p, (uint8_t)on_worker);
  put_u8(&p, (uint8_t)delayed);
  send_frame(F_CFG_DESTROYED, id, &p);
  buf_free(&p);
}

// ~FilterConfig (gf.cc:1606): runs on whichever thread drops the last
// reference, after the weak_ptr Go's config calls go through has expired.
static void cfg_release(fconfig_t *c, int on_worker) {
  pthread_mutex_lock(&cfg_mu);
  int last = --c->refs == 0;
  if (last && c->h) c->h->weak = NULL; // weak_ptr expires before the destructor body
  pthread_mutex_unlock(&cfg_mu);
  if (!last) return;
  uint64_t t0 = now_us();
  so.destroy_cfg(c->id, 0);
  uint64_t us = now_us() - t0;
  fprintf(stderr, "envoyhost: config %lu destroyed in %lu us (%s thread)\n", (unsigned long)c->id,
          (unsigned long)us, on_worker ? "worker" : "main");
  report_destroyed(c->id, us, on_worker, 0);
  free(c->buf);
  free(c);
}

static fconfig_t *cfg_lock_weak(void *c) {
  hconfig_t *h = c;
  pthread_mutex_lock(&cfg_mu);
  fconfig_t *f = h->weak;
  if (f) f->refs++;
  pthread_mutex_unlock(&cfg_mu);
  return f;
}

// ---------------------------------------------------------------- streams

// FilterState, ps.h:48
enum { WaitingHeader, ProcessingHeader, WaitingData, WaitingAllData, ProcessingData, WaitingTrailer,
       ProcessingTrailer, Done };
// GolangStatus, ps.h:70
enum { GRunning, GLocalReply, GContinue, GStopAndBuffer, GStopAndBufferWatermark, GStopNoBuffer };

typedef struct filter filter_t;
typedef struct req req_t;

#define MAX_DODATA 64
typedef struct {
  processState base; // must be first: Go sees processState*
  req_t *r;
  int is_enc;
  buf_t data_buffer; // data_buffer_ (watermark buffer)
  int has_data_buffer;
  int above_high;           // watermark crossed
  buf_t *dodata[MAX_DODATA]; // doDataList (BufferList, ps.cc:11)
  int ndodata;
  hmap_t *headers, *trailers;
  int end_stream, do_end_stream;
} pstate_t;

// HttpRequestInternal (golang_filter.h:183): raw memory Go keys its requests by,
// freed by Go's finalizer (cgo.cc:303) or in onDestroy if Go never saw it.
struct req {
  httpRequest base; // must be first
  pstate_t dec, enc;
  filter_t *filter; // weak: valid while !filter->dead
  char *str_value;  // strValue anchor
  size_t str_len;
  int freed_by_go;
};

typedef struct {
  char *name;
  buf_t fields; // serialized Struct fields (map entries), last write wins
  hmap_t kv;    // key -> serialized Value
} dynmeta_t;

struct filter {
  uint64_t sid;
  worker_t *w;
  fconfig_t *cfg;
  req_t *req;
  pthread_mutex_t mu; // Filter::mutex_
  int has_destroyed;
  int dead;       // deferred-deleted: weak_ptr expired
  int weak_locks; // in-flight weak_ptr::lock()s, guarded by weak_mu
  int req_gone;   // req freed

  hmap_t req_headers, req_trailers, resp_headers, resp_trailers;
  int have_req_trailers, have_resp_headers, have_resp_trailers;
  int req_headers_end, resp_headers_end;
  // filter manager / router side
  int fwd_headers, fwd_done, fwd_trailers_stopped, fwd_added;
  buf_t dec_added, enc_added; // add{De,En}codedData
  int cli_headers, cli_done, cli_trailers_stopped;
  int local_reply, decoding_aborted, completed;
  char *override_host;
  int override_strict;
  char *route_key; // cached route: the x-llm-cluster header when the route was computed
  int route_cached;
  // stream info
  char *upstream_host, *cluster, *details;
  int response_code, attempts;
  dynmeta_t meta[8];
  int nmeta;
  hmap_t filter_state;
};

static pthread_mutex_t weak_mu = PTHREAD_MUTEX_INITIALIZER;

// Requests Go saw, and the ones its GC finalized (cgo.cc:303).
static _Atomic(long) requests_in_go, requests_finalized, configs_finalized;

static void filter_free(filter_t *f) {
  h_free(&f->req_headers);
  h_free(&f->req_trailers);
  h_free(&f->resp_headers);
  h_free(&f->resp_trailers);
  buf_free(&f->dec_added);
  buf_free(&f->enc_added);
  free(f->override_host);
  free(f->route_key);
  free(f->upstream_host);
  free(f->cluster);
  free(f->details);
  for (int i = 0; i < f->nmeta; i++) {
    free(f->meta[i].name);
    h_free(&f->meta[i].kv);
  }
  h_free(&f->filter_state);
  free(f);
}

static void req_free(req_t *r) {
  for (int s = 0; s < 2; s++) {
    pstate_t *p = s ? &r->enc : &r->dec;
    buf_free(&p->data_buffer);
    for (int i = 0; i < p->ndodata; i++) {
      buf_free(p->dodata[i]);
      free(p->dodata[i]);
    }
  }
  free(r->str_value);
  free(r);
}

// weak_ptr<Filter>::lock() on the request (cgo.cc:60).
static filter_t *weak_lock(req_t *r) {
  pthread_mutex_lock(&weak_mu);
  filter_t *f = r->filter;
  if (f && (f->dead || r->freed_by_go)) f = NULL;
  if (f) f->weak_locks++;
  pthread_mutex_unlock(&weak_mu);
  return f;
}
static void weak_unlock(filter_t *f) {
  pthread_mutex_lock(&weak_mu);
  int free_it = --f->weak_locks == 0 && f->dead && f->req_gone;
  pthread_mutex_unlock(&weak_mu);
  if (free_it) filter_free(f);
}

static int in_go(pstate_t *s) {
  int st = s->base.state;
  return st == ProcessingHeader || st == ProcessingData || st == ProcessingTrailer ||
         atomic_load(&s->r->base.is_golang_processing_log);
}
static int filter_in_go(filter_t *f) { return in_go(&f->req->dec) || in_go(&f->req->enc); }

static int has_destroyed(filter_t *f) {
  pthread_mutex_lock(&f->mu);
  int d = f->has_destroyed;
  pthread_mutex_unlock(&f->mu);
  return d;
}

// A posted closure keeps the filter (shared_ptr captured weakly, then
// checked: "!weak_ptr.expired() && !hasDestroyed()").
typedef struct {
  filter_t *f;
  pstate_t *s;
  void (*fn)(filter_t *, pstate_t *, void *);
  void *arg;
  void (*skip)(filter_t *, void *); // runs instead when the filter is gone
} posted_t;

static void run_posted(void *a) {
  posted_t *p = a;
  pthread_mutex_lock(&weak_mu);
  int alive = !p->f->dead;
  pthread_mutex_unlock(&weak_mu);
  if (alive && !has_destroyed(p->f))
    p->fn(p->f, p->s, p->arg);
  else if (p->skip)
    p->skip(p->f, p->arg);
  else
    free(p->arg);
  weak_unlock(p->f);
  free(p);
}

// The filter pointer f was obtained by weak_lock; the closure holds that lock.
static void post_filter(filter_t *f, pstate_t *s, void (*fn)(filter_t *, pstate_t *, void *),
                        void *arg) {
  posted_t *p = xmalloc(sizeof *p);
  pthread_mutex_lock(&weak_mu);
  f->weak_locks++;
  pthread_mutex_unlock(&weak_mu);
  p->f = f;
  p->s = s;
  p->fn = fn;
  p->arg = arg;
  post(f->w, run_posted, p);
}

// ------------------------------------------------ filter manager side (to the driver)

static void route_snapshot(filter_t *f) {
  // The route is computed (and cached) when the filter chain first asks
  // for it; getMergedConfigId does at the first callback (gf.cc:1552).
  if (f->route_cached) return;
  hdr_t *h = h_get(&f->req_headers, "x-llm-cluster");
  free(f->route_key);
  f->route_key = h ? xstrndup(h->v, h->vl) : xstrndup("", 0);
  f->route_cached = 1;
}

static void fm_forward_headers(filter_t *f, int end) {
  if (f->fwd_headers || f->decoding_aborted) return;
  f->fwd_headers = 1;
  route_snapshot(f);
  buf_t p = {0};
  put_u8(&p, (uint8_t)(end && f->dec_added.len == 0));
  put_hmap(&p, &f->req_headers);
  const char *oh = f->override_host ? f->override_host : "";
  put_str(&p, oh, strlen(oh));
  put_u8(&p, (uint8_t)f->override_strict);
  put_str(&p, f->route_key, strlen(f->route_key));
  send_frame(F_FWD_HEADERS, f->sid, &p);
  buf_free(&p);
  if (f->dec_added.len) {
    buf_t d = {0};
    put_u8(&d, (uint8_t)end);
    buf_add(&d, f->dec_added.p, f->dec_added.len);
    f->dec_added.len = 0;
    send_frame(F_FWD_DATA, f->sid, &d);
    buf_free(&d);
  }
  if (end) f->fwd_done = 1;
}

static void fm_forward_data(filter_t *f, buf_t *data, int end) {
  if (f->decoding_aborted || f->fwd_done) return;
  fm_forward_headers(f, 0);
  buf_t p = {0};
  put_u8(&p, (uint8_t)end);
  buf_add(&p, data->p, data->len);
  send_frame(F_FWD_DATA, f->sid, &p);
  buf_free(&p);
  if (end) f->fwd_done = 1;
}

static void fm_forward_trailers(filter_t *f) {
  if (f->decoding_aborted || f->fwd_done) return;
  fm_forward_headers(f, 0);
  if (f->dec_added.len) { // addDecodedData from decodeTrailers: data before trailers
    buf_t d = {0};
    buf_move(&d, &f->dec_added);
    fm_forward_data(f, &d, 0);
    buf_free(&d);
  }
  buf_t p = {0};
  put_hmap(&p, &f->req_trailers);
  send_frame(F_FWD_TRAILERS, f->sid, &p);
  buf_free(&p);
  f->fwd_done = 1;
}

static void stream_complete(filter_t *f, int reset);

static void fm_client_headers(filter_t *f, int end) {
  if (f->cli_headers || f->completed) return;
  f->cli_headers = 1;
  buf_t p = {0};
  put_u8(&p, (uint8_t)(end && f->enc_added.len == 0));
  put_hmap(&p, &f->resp_headers);
  send_frame(F_CLIENT_HEADERS, f->sid, &p);
  buf_free(&p);
  if (f->enc_added.len) {
    buf_t d = {0};
    put_u8(&d, (uint8_t)end);
    buf_add(&d, f->enc_added.p, f->enc_added.len);
    f->enc_added.len = 0;
    send_frame(F_CLIENT_DATA, f->sid, &d);
    buf_free(&d);
  }
  if (end) {
    f->cli_done = 1;
    stream_complete(f, 0);
  }
}

static void fm_client_data(filter_t *f, buf_t *data, int end) {
  if (f->cli_done || f->completed) return;
  fm_client_headers(f, 0);
  buf_t p = {0};
  put_u8(&p, (uint8_t)end);
  buf_add(&p, data->p, data->len);
  send_frame(F_CLIENT_DATA, f->sid, &p);
  buf_free(&p);
  if (end) {
    f->cli_done = 1;
    stream_complete(f, 0);
  }
}

static void fm_client_trailers(filter_t *f) {
  if (f->cli_done || f->completed) return;
  fm_client_headers(f, 0);
  if (f->enc_added.len) {
    buf_t d = {0};
    buf_move(&d, &f->enc_added);
    fm_client_data(f, &d, 0);
    buf_free(&d);
  }
  buf_t p = {0};
  put_hmap(&p, &f->resp_trailers);
  send_frame(F_CLIENT_TRAILERS, f->sid, &p);
  buf_free(&p);
  f->cli_done = 1;
  stream_complete(f, 0);
}

static void encode_headers(filter_t *f, int end);
static void encode_data(filter_t *f, buf_t *data, int end);

// The HTTP connection manager's local_reply_config (LocalReplyImpl::rewrite,
// source/common/local_reply/local_reply.cc), for the shape istio/ ships: a
// first mapper that leaves replies whose dynamic metadata has skip_ns.skip_key
// = true alone, a second that rewrites every other reply with status >=
// min_status to a JSON body_format. The template is the json_format as JSON
// text: "%RESPONSE_CODE%" as a whole value becomes a number (Envoy keeps
// single-operator values typed); the other operators are replaced inside
// strings, JSON-escaped.
static dynmeta_t *meta_for(filter_t *f, const char *name, size_t n, int create);
static pthread_mutex_t lr_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  int set;
  char *skip_ns, *skip_key, *tmpl;
  uint32_t min_status;
} lr;

static void set_local_reply(uint64_t rid, const char *p, size_t n) {
  rd_t r = {p, n, 0};
  size_t nl, kl, tl;
  const char *ns = get_str(&r, &nl);
  const char *key = get_str(&r, &kl);
  uint32_t min_status = get_u32(&r);
  const char *t = get_str(&r, &tl);
  pthread_mutex_lock(&lr_mu);
  free(lr.skip_ns);
  free(lr.skip_key);
  free(lr.tmpl);
  lr.skip_ns = xstrndup(ns, nl);
  lr.skip_key = xstrndup(key, kl);
  lr.tmpl = xstrndup(t, tl);
  lr.min_status = min_status;
  lr.set = tl > 0;
  pthread_mutex_unlock(&lr_mu);
  send_frame(F_LOCAL_REPLY_SET, rid, NULL);
}

static void json_escape(buf_t *b, const char *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') {
      buf_add(b, "\\", 1);
      buf_add(b, &s[i], 1);
    } else if (c < 0x20) {
      char e[8];
      int k = snprintf(e, sizeof e, "\\u%04x", c);
      buf_add(b, e, (size_t)k);
    } else {
      buf_add(b, &s[i], 1);
    }
  }
}

static int starts(const char *p, const char *end, const char *lit) {
  size_t n = strlen(lit);
  return (size_t)(end - p) >= n && !memcmp(p, lit, n);
}

// local_reply_rewrite returns 1 and fills out when the reply is rewritten.
static int local_reply_rewrite(filter_t *f, int code, const char *body, size_t body_len, const char *details, buf_t *out) {
  pthread_mutex_lock(&lr_mu);
  if (!lr.set || code < (int)lr.min_status) {
    pthread_mutex_unlock(&lr_mu);
    return 0;
  }
  // First mapper: the filter's own replies (bool true = Value field 4, varint 1).
  dynmeta_t *m = meta_for(f, lr.skip_ns, strlen(lr.skip_ns), 0);
  hdr_t *mark = m ? h_get(&m->kv, lr.skip_key) : NULL;
  if (mark && mark->vl == 2 && (unsigned char)mark->v[0] == 0x20 && mark->v[1] == 1) {
    pthread_mutex_unlock(&lr_mu);
    return 0;
  }
  hdr_t *rid = h_get(&f->req_headers, "x-request-id");
  char num[16];
  int nn = snprintf(num, sizeof num, "%d", code);
  const char *p = lr.tmpl, *end = lr.tmpl + strlen(lr.tmpl);
  while (p < end) {
    if (starts(p, end, "\"%RESPONSE_CODE%\"")) {
      buf_add(out, num, (size_t)nn);
      p += strlen("\"%RESPONSE_CODE%\"");
    } else if (starts(p, end, "%RESPONSE_CODE_DETAILS%")) {
      json_escape(out, details, strlen(details));
      p += strlen("%RESPONSE_CODE_DETAILS%");
    } else if (starts(p, end, "%LOCAL_REPLY_BODY%")) {
      json_escape(out, body, body_len);
      p += strlen("%LOCAL_REPLY_BODY%");
    } else if (starts(p, end, "%REQ(X-REQUEST-ID)%")) {
      if (rid) json_escape(out, rid->v, rid->vl);
      p += strlen("%REQ(X-REQUEST-ID)%");
    } else if (starts(p, end, "%RESPONSE_CODE%")) {
      buf_add(out, num, (size_t)nn);
      p += strlen("%RESPONSE_CODE%");
    } else {
      buf_add(out, p, 1);
      p++;
    }
  }
  pthread_mutex_unlock(&lr_mu);
  return 1;
}

// FilterManager::sendLocalReply: through the encoder filters while no
// response headers exist; straight to the client once an upstream response
// is being encoded but not sent; a reset once headers went out.
static void fm_send_local_reply(filter_t *f, int code, const char *body, size_t body_len,
                                hmap_t *extra, const char *details) {
  if (f->completed) return;
  f->local_reply = 1;
  f->decoding_aborted = 1;
  free(f->details);
  f->details = xstrndup(details, strlen(details));
  send_frame(F_UPSTREAM_CANCEL, f->sid, NULL);
  if (f->cli_headers) {
    stream_complete(f, 1);
    return;
  }
  buf_t mapped = {0};
  const char *ctype = "text/plain";
  if (local_reply_rewrite(f, code, body, body_len, details, &mapped)) {
    body = mapped.p;
    body_len = mapped.len;
    ctype = "application/json";
  }
  hmap_t h = {0};
  char st[16];
  int n = snprintf(st, sizeof st, "%d", code);
  h_add(&h, ":status", 7, st, (size_t)n);
  if (body_len) {
    char cl[32];
    n = snprintf(cl, sizeof cl, "%zu", body_len);
    h_add(&h, "content-length", 14, cl, (size_t)n);
    h_add(&h, "content-type", 12, ctype, strlen(ctype));
  }
  for (int i = 0; extra && i < extra->n; i++)
    if (extra->a[i].vl > 0) h_set(&h, extra->a[i].k, extra->a[i].kl, extra->a[i].v, extra->a[i].vl);
  f->response_code = code;
  if (f->have_resp_headers) { // sendDirectLocalReply: bypasses the filters
    h_free(&f->resp_headers);
    f->resp_headers = h;
    f->enc_added.len = 0;
    fm_client_headers(f, body_len == 0);
    if (body_len) {
      buf_t b = {0};
      buf_add(&b, body, body_len);
      fm_client_data(f, &b, 1);
      buf_free(&b);
    }
    buf_free(&mapped);
    return;
  }
  h_free(&f->resp_headers);
  f->resp_headers = h;
  f->have_resp_headers = 1;
  f->resp_headers_end = body_len == 0;
  encode_headers(f, body_len == 0);
  if (body_len && !f->completed) {
    buf_t b = {0};
    buf_add(&b, body, body_len);
    encode_data(f, &b, 1);
    buf_free(&b);
  }
  buf_free(&mapped);
}

// ------------------------------------------------ ProcessorState (ps.cc, ps.h)

static int state_is_stream_end(pstate_t *s) { return s->end_stream || s->trailers != NULL; }
static int buffer_empty(pstate_t *s) { return !s->has_data_buffer || s->data_buffer.len == 0; }

static buf_t *dodata_push(pstate_t *s, buf_t *data) {
  if (s->ndodata == MAX_DODATA) die("doDataList overflow");
  buf_t *b = xmalloc(sizeof *b);
  buf_move(b, data);
  s->dodata[s->ndodata++] = b;
  return b;
}
static void dodata_moveout(pstate_t *s, buf_t *out) {
  for (int i = 0; i < s->ndodata; i++) {
    buf_move(out, s->dodata[i]);
    buf_free(s->dodata[i]);
    free(s->dodata[i]);
  }
  s->ndodata = 0;
}
static void dodata_clear_latest(pstate_t *s) {
  if (!s->ndodata) return;
  buf_t *b = s->dodata[--s->ndodata];
  buf_free(b);
  free(b);
}
static void dodata_clear(pstate_t *s) {
  buf_t tmp = {0};
  dodata_moveout(s, &tmp);
  buf_free(&tmp);
}
static int dodata_has(pstate_t *s, buf_t *b) {
  for (int i = 0; i < s->ndodata; i++)
    if (s->dodata[i] == b) return 1;
  return 0;
}

// addBufferData with the watermark callbacks of ps.cc:276 (decoder: 413 when
// buffering all data) and ps.cc:308 (encoder: 500).
static void add_buffer_data(filter_t *f, pstate_t *s, buf_t *data) {
  s->has_data_buffer = 1;
  buf_move(&s->data_buffer, data);
  uint64_t limit = s->is_enc ? encoder_limit : decoder_limit;
  if (s->data_buffer.len > limit && !s->above_high) {
    s->above_high = 1;
    if (s->base.state == WaitingAllData) {
      if (s->is_enc)
        fm_send_local_reply(f, 500, "Internal Server Error", 21, NULL, "response_payload_too_large");
      else
        fm_send_local_reply(f, 413, "Payload Too Large", 17, NULL, "request_payload_too_large");
      return;
    }
    // StopAndBufferWatermark: Envoy disables reading here
    // (onDecoderFilterAboveWriteBufferHighWatermark); the driver keeps
    // reading, see docs/envoy-filter.md.
  } else if (s->above_high && s->data_buffer.len <= limit / 2) {
    s->above_high = 0;
  }
}

static void continue_processing(filter_t *f, pstate_t *s) {
  if (!s->is_enc) {
    fm_forward_headers(f, f->req_headers_end);
    if (f->fwd_trailers_stopped && s->base.state == Done) {
      f->fwd_trailers_stopped = 0;
      fm_forward_trailers(f);
    }
  } else {
    fm_client_headers(f, f->resp_headers_end);
    if (f->cli_trailers_stopped && s->base.state == Done) {
      f->cli_trailers_stopped = 0;
      fm_client_trailers(f);
    }
  }
}

static void inject_data(filter_t *f, pstate_t *s, buf_t *data, int end) {
  if (!s->is_enc)
    fm_forward_data(f, data, end);
  else
    fm_client_data(f, data, end);
}

static void continue_do_data(filter_t *f, pstate_t *s) {
  if (!s->end_stream && s->ndodata == 0) return;
  buf_t out = {0};
  dodata_moveout(s, &out);
  inject_data(f, s, &out, s->do_end_stream);
  buf_free(&out);
}

static int handle_header_status(pstate_t *s, int status) {
  int done = 0;
  switch (status) {
  case GLocalReply:
  case GRunning:
    break;
  case GContinue:
    s->base.state = s->do_end_stream ? Done : WaitingData;
    done = 1;
    break;
  case GStopAndBuffer:
    s->base.state = WaitingAllData;
    break;
  case GStopAndBufferWatermark:
    s->base.state = WaitingData;
    break;
  default:
    fprintf(stderr, "envoyhost: [error] unexpected status: %d\n", status);
  }
  return done;
}

static int handle_data_status(pstate_t *s, int status) {
  int done = 0;
  switch (status) {
  case GLocalReply:
  case GRunning:
    return 0;
  case GContinue:
    s->base.state = s->do_end_stream ? Done : WaitingData;
    done = 1;
    break;
  case GStopAndBuffer:
    if (s->do_end_stream) fprintf(stderr, "envoyhost: [error] want more data while stream is end\n");
    s->base.state = WaitingAllData;
    break;
  case GStopAndBufferWatermark:
    if (s->do_end_stream) fprintf(stderr, "envoyhost: [error] want more data while stream is end\n");
    s->base.state = WaitingData;
    break;
  case GStopNoBuffer:
    if (s->do_end_stream) fprintf(stderr, "envoyhost: [error] want more data while stream is end\n");
    dodata_clear_latest(s);
    s->base.state = WaitingData;
    break;
  default:
    fprintf(stderr, "envoyhost: [error] unexpected status: %d\n", status);
  }
  if (s->trailers != NULL && buffer_empty(s)) s->base.state = WaitingTrailer;
  return done;
}

static int handle_trailer_status(pstate_t *s, int status) {
  switch (status) {
  case GLocalReply:
  case GRunning:
    return 0;
  case GContinue:
    s->base.state = Done;
    return 1;
  default:
    fprintf(stderr, "envoyhost: [error] unexpected status: %d\n", status);
    return 0;
  }
}

// ------------------------------------------------ Filter (gf.cc)

static uint64_t merged_config_id(filter_t *f);

static void init_request(filter_t *f) { // gf.cc:1486
  if (f->req->base.configId == 0) {
    atomic_fetch_add(&requests_in_go, 1);
    f->req->base.configId = merged_config_id(f);
  }
}

static int do_headers(filter_t *f, pstate_t *s, hmap_t *h, int end) { // gf.cc:250
  s->headers = h;
  s->base.state = ProcessingHeader;
  s->do_end_stream = end;
  init_request(f);
  int st = (int)so.on_header(&s->base, end ? 1 : 0, (uint64_t)h->n, h_bytes(h));
  int done = handle_header_status(s, st);
  if (done) s->headers = NULL;
  return done;
}

static int do_data_go(filter_t *f, pstate_t *s, buf_t *data, int end) { // gf.cc:267
  s->base.state = ProcessingData;
  s->do_end_stream = end;
  buf_t *b = dodata_push(s, data);
  int st = (int)so.on_data(&s->base, end ? 1 : 0, (uint64_t)(uintptr_t)b, b->len);
  (void)f;
  return handle_data_status(s, st);
}

static int do_data(filter_t *f, pstate_t *s, buf_t *data, int end) { // gf.cc:282
  int done = 0;
  switch (s->base.state) {
  case WaitingData:
    done = do_data_go(f, s, data, end);
    break;
  case WaitingAllData:
    if (end) {
      if (!buffer_empty(s)) {
        add_buffer_data(f, s, data);
        buf_move(data, &s->data_buffer);
        // Over the limit: the 413 ended the stream; the filter (already
        // destroyed here, where Envoy defers it) never sees this data.
        if (f->decoding_aborted) break;
      }
      if (s->base.state == WaitingAllData) done = do_data_go(f, s, data, end);
      break;
    }
    /* fallthrough */
  case ProcessingHeader:
  case ProcessingData:
    add_buffer_data(f, s, data);
    break;
  default:
    fprintf(stderr, "envoyhost: [error] unexpected state: %d\n", s->base.state);
  }
  return done;
}

static int do_trailer_go(filter_t *f, pstate_t *s, hmap_t *t) { // gf.cc:322
  s->base.state = ProcessingTrailer;
  s->do_end_stream = 1;
  (void)f;
  int st = (int)so.on_header(&s->base, 1, (uint64_t)t->n, h_bytes(t));
  return handle_trailer_status(s, st);
}

static int do_trailer(filter_t *f, pstate_t *s, hmap_t *t) { // gf.cc:333
  s->trailers = t;
  int done = 0;
  switch (s->base.state) {
  case WaitingTrailer:
  case WaitingData:
    done = do_trailer_go(f, s, t);
    break;
  case WaitingAllData:
    if (!buffer_empty(s)) {
      buf_t tmp = {0};
      buf_move(&tmp, &s->data_buffer);
      done = do_data_go(f, s, &tmp, 0);
      buf_free(&tmp);
      if (s->base.state == WaitingTrailer) {
        continue_do_data(f, s);
        done = do_trailer_go(f, s, t);
      }
    } else {
      continue_do_data(f, s);
      done = do_trailer_go(f, s, t);
    }
    break;
  case ProcessingHeader:
  case ProcessingData:
    break;
  default:
    fprintf(stderr, "envoyhost: [error] unexpected state: %d\n", s->base.state);
  }
  return done;
}

// continueStatusInternal, gf.cc:384
static void continue_status_internal(filter_t *f, pstate_t *s, int status) {
  int saved = s->base.state;
  int done;
  switch (saved) {
  case ProcessingHeader:
    done = handle_header_status(s, status);
    break;
  case ProcessingData:
    done = handle_data_status(s, status);
    break;
  case ProcessingTrailer:
    done = handle_trailer_status(s, status);
    break;
  default:
    die("continueStatusInternal: unexpected state %d", saved); // ASSERT(0)
  }
  if (done) {
    switch (saved) {
    case ProcessingHeader:
      s->headers = NULL;
      if (s->do_end_stream || !state_is_stream_end(s)) continue_processing(f, s);
      break;
    case ProcessingData:
      continue_do_data(f, s);
      break;
    case ProcessingTrailer:
      continue_do_data(f, s);
      continue_processing(f, s);
      break;
    }
  }
  int cur = s->base.state;
  if ((cur == WaitingData && (!buffer_empty(s) || s->end_stream)) ||
      (cur == WaitingAllData && state_is_stream_end(s))) {
    buf_t tmp = {0};
    buf_move(&tmp, &s->data_buffer);
    int d = do_data_go(f, s, &tmp, s->end_stream);
    buf_free(&tmp);
    if (d)
      continue_do_data(f, s);
    else
      return;
  }
  if (s->base.state == WaitingTrailer && s->trailers != NULL) {
    if (do_trailer_go(f, s, s->trailers)) continue_processing(f, s);
  }
}

// ------------------------------------------------ stream events from the driver

// access_log is the HCM access log: one stderr line with the response code
// and every dynamic metadata key, its serialized google.protobuf.Value in
// hex (the driver decodes it: Host.AccessLog).
static void access_log(filter_t *f) {
  buf_t out = {0};
  char head[128];
  int n = snprintf(head, sizeof head, "envoyhost: access-log code=%d", f->response_code);
  buf_add(&out, head, (size_t)n);
  // Worker thread: the posted metadata writes run here too.
  for (int i = 0; i < f->nmeta; i++) {
    for (int j = 0; j < f->meta[i].kv.n; j++) {
      hdr_t *e = &f->meta[i].kv.a[j];
      buf_add(&out, " ", 1);
      buf_add(&out, f->meta[i].name, strlen(f->meta[i].name));
      buf_add(&out, ":", 1);
      buf_add(&out, e->k, e->kl);
      buf_add(&out, "=", 1);
      for (size_t k = 0; k < e->vl; k++) {
        char hx[3];
        snprintf(hx, sizeof hx, "%02x", (unsigned char)e->v[k]);
        buf_add(&out, hx, 2);
      }
    }
  }
  buf_add(&out, "\n", 1);
  fwrite(out.p, 1, out.len, stderr);
  fflush(stderr);
  buf_free(&out);
}

static void stream_complete(filter_t *f, int reset) {
  if (f->completed) return;
  f->completed = 1;
  req_t *r = f->req;
  // ActiveStream completion: onStreamComplete, access log (DownstreamEnd),
  // then onDestroy, then deferred deletion of the filter.
  // The HCM's access loggers were added to the stream before any filter
  // (ActiveStream's constructor), so they run before the golang filter's
  // log: they see the dynamic metadata the filter set until now.
  access_log(f);
  if (r->base.configId != 0) {
    atomic_store(&r->base.is_golang_processing_log, 1); // gf.cc:138
    so.on_stream_complete(&r->base);
    atomic_store(&r->base.is_golang_processing_log, 0);
    // Filter::log, gf.cc:171
    r->dec.headers = &f->req_headers;
    r->dec.trailers = f->have_req_trailers ? &f->req_trailers : NULL;
    r->enc.headers = f->have_resp_headers ? &f->resp_headers : NULL;
    r->enc.trailers = f->have_resp_trailers ? &f->resp_trailers : NULL;
    atomic_store(&r->base.is_golang_processing_log, 1);
    so.on_log(&r->base, 6 /* AccessLogDownstreamEnd */, &r->dec.base, &r->enc.base,
              (uint64_t)f->req_headers.n, h_bytes(&f->req_headers),
              f->have_req_trailers ? (uint64_t)f->req_trailers.n : 0,
              f->have_req_trailers ? h_bytes(&f->req_trailers) : 0,
              f->have_resp_headers ? (uint64_t)f->resp_headers.n : 0,
              f->have_resp_headers ? h_bytes(&f->resp_headers) : 0,
              f->have_resp_trailers ? (uint64_t)f->resp_trailers.n : 0,
              f->have_resp_trailers ? h_bytes(&f->resp_trailers) : 0);
    atomic_store(&r->base.is_golang_processing_log, 0);
  }
  // onDestroy, gf.cc:143
  if (r->base.configId == 0) {
    pthread_mutex_lock(&weak_mu);
    f->req_gone = 1;
    r->freed_by_go = 1;
    pthread_mutex_unlock(&weak_mu);
    req_free(r);
  } else {
    pthread_mutex_lock(&f->mu);
    int already = f->has_destroyed;
    f->has_destroyed = 1;
    pthread_mutex_unlock(&f->mu);
    if (!already) {
      int reason = (in_go(&r->dec) || in_go(&r->enc)) ? 1 : 0;
      so.on_destroy(&r->base, (uint64_t)reason);
    }
  }
  buf_t p = {0};
  put_u8(&p, (uint8_t)reset);
  send_frame(F_STREAM_END, f->sid, &p);
  buf_free(&p);
}

// Deferred deletion of the Filter: the weak_ptr expires, the config
// reference drops (possibly the last one: ~FilterConfig on this worker).
static void filter_delete(void *a) {
  filter_t *f = a;
  fconfig_t *c = f->cfg;
  pthread_mutex_lock(&weak_mu);
  f->dead = 1;
  int free_it = f->weak_locks == 0 && f->req_gone;
  pthread_mutex_unlock(&weak_mu);
  if (free_it) filter_free(f);
  cfg_release(c, 1);
}

#define MAX_STREAMS 4096
typedef struct {
  uint64_t sid;
  filter_t *f;
} slot_t;

// Per worker stream table (only touched on the worker's thread).
typedef struct {
  slot_t *a;
  int n, cap;
} stable_t;
static stable_t *tables;

static filter_t *stream_find(worker_t *w, uint64_t sid) {
  stable_t *t = &tables[w->id];
  for (int i = 0; i < t->n; i++)
    if (t->a[i].sid == sid) return t->a[i].f;
  return NULL;
}
static void stream_forget(worker_t *w, uint64_t sid) {
  stable_t *t = &tables[w->id];
  for (int i = 0; i < t->n; i++)
    if (t->a[i].sid == sid) {
      t->a[i] = t->a[--t->n];
      return;
    }
}

static void maybe_finish(filter_t *f) {
  if (f->completed) {
    stream_forget(f->w, f->sid);
    post(f->w, filter_delete, f);
  }
}

typedef struct {
  uint8_t type;
  uint64_t sid;
  worker_t *w;
  char *p;
  size_t len;
} ev_t;

static void encode_headers(filter_t *f, int end) { // gf.cc:88
  pstate_t *s = &f->req->enc;
  s->end_stream = end;
  if (s->base.state != WaitingHeader) {
    fprintf(stderr, "envoyhost: [error] encodeHeaders in state %d\n", s->base.state);
    return;
  }
  if (do_headers(f, s, &f->resp_headers, end)) fm_client_headers(f, end);
}

static void encode_data(filter_t *f, buf_t *data, int end) { // gf.cc:107
  pstate_t *s = &f->req->enc;
  s->end_stream = end;
  if (do_data(f, s, data, end)) {
    buf_t out = {0};
    dodata_moveout(s, &out);
    buf_move(&out, data);
    fm_client_data(f, &out, end);
    buf_free(&out);
  }
}

static void on_event(void *a) {
  ev_t *e = a;
  rd_t r = {e->p, e->len, 0};
  filter_t *f = stream_find(e->w, e->sid);
  if (e->type == F_REQ_HEADERS) {
    if (f) die("duplicate stream %lu", (unsigned long)e->sid);
    f = xmalloc(sizeof *f);
    f->sid = e->sid;
    f->w = e->w;
    pthread_mutex_init(&f->mu, NULL);
    pthread_mutex_lock(&cfg_mu);
    f->cfg = current_cfg;
    if (f->cfg) f->cfg->refs++;
    pthread_mutex_unlock(&cfg_mu);
    if (!f->cfg) die("request before any config was pushed");
    req_t *rq = xmalloc(sizeof *rq);
    rq->base.plugin_name.data = plugin_name;
    rq->base.plugin_name.len = strlen(plugin_name);
    rq->base.worker_id = e->w->id;
    rq->dec.base.req = &rq->base;
    rq->dec.base.is_encoding = 0;
    rq->dec.r = rq;
    rq->enc.base.req = &rq->base;
    rq->enc.base.is_encoding = 1;
    rq->enc.is_enc = 1;
    rq->enc.r = rq;
    rq->filter = f;
    f->req = rq;
    f->attempts = 1;
    stable_t *t = &tables[e->w->id];
    if (t->n == t->cap) {
      t->cap = t->cap ? t->cap * 2 : 64;
      t->a = realloc(t->a, sizeof(slot_t) * t->cap);
    }
    t->a[t->n++] = (slot_t){e->sid, f};
    int end = get_u8(&r);
    get_hmap(&r, &f->req_headers);
    f->req_headers_end = end;
    pstate_t *s = &rq->dec;
    s->end_stream = end;
    if (do_headers(f, s, &f->req_headers, end)) fm_forward_headers(f, end);
  } else if (!f) {
    // the stream ended already (local reply, reset): late frames are dropped
  } else if (e->type == F_REQ_DATA) {
    int end = get_u8(&r);
    buf_t d = {0};
    buf_add(&d, r.p + r.off, r.len - r.off);
    if (!f->decoding_aborted) {
      pstate_t *s = &f->req->dec;
      s->end_stream = end;
      if (do_data(f, s, &d, end)) {
        buf_t out = {0};
        dodata_moveout(s, &out);
        buf_move(&out, &d);
        fm_forward_data(f, &out, end);
        buf_free(&out);
      }
    }
    buf_free(&d);
  } else if (e->type == F_REQ_TRAILERS) {
    get_hmap(&r, &f->req_trailers);
    f->have_req_trailers = 1;
    if (!f->decoding_aborted) {
      if (do_trailer(f, &f->req->dec, &f->req_trailers))
        fm_forward_trailers(f);
      else
        f->fwd_trailers_stopped = 1;
    }
  } else if (e->type == F_RESP_HEADERS) {
    int end = get_u8(&r);
    size_t n, hn;
    const char *host = get_str(&r, &hn);
    free(f->upstream_host);
    f->upstream_host = hn ? xstrndup(host, hn) : NULL;
    const char *cl = get_str(&r, &n);
    free(f->cluster);
    f->cluster = n ? xstrndup(cl, n) : NULL;
    f->attempts = get_u8(&r);
    const char *det = get_str(&r, &n);
    hmap_t h = {0};
    get_hmap(&r, &h);
    if (f->local_reply) {
      h_free(&h);
    } else if (hn == 0 && n) {
      // The router's own local reply (no healthy upstream, connect failure).
      hdr_t *st = h_get(&h, ":status");
      char *body = xstrndup(r.p + r.off, r.len - r.off);
      char *details = xstrndup(det, n);
      int code = st ? atoi(st->v) : 503;
      h_remove(&h, ":status", 7);
      fm_send_local_reply(f, code, body, strlen(body), &h, details);
      free(body);
      free(details);
      h_free(&h);
    } else {
      h_free(&f->resp_headers);
      f->resp_headers = h;
      f->have_resp_headers = 1;
      f->resp_headers_end = end;
      hdr_t *st = h_get(&h, ":status");
      f->response_code = st ? atoi(st->v) : 0;
      encode_headers(f, end);
    }
  } else if (e->type == F_RESP_DATA) {
    int end = get_u8(&r);
    buf_t d = {0};
    buf_add(&d, r.p + r.off, r.len - r.off);
    if (!f->local_reply) encode_data(f, &d, end);
    buf_free(&d);
  } else if (e->type == F_RESP_TRAILERS) {
    get_hmap(&r, &f->resp_trailers);
    f->have_resp_trailers = 1;
    if (!f->local_reply) {
      if (do_trailer(f, &f->req->enc, &f->resp_trailers))
        fm_client_trailers(f);
      else
        f->cli_trailers_stopped = 1;
    }
  } else if (e->type == F_RESET) {
    if (!f->completed) {
      send_frame(F_UPSTREAM_CANCEL, f->sid, NULL);
      stream_complete(f, 1);
    }
  }
  if (f) maybe_finish(f);
  free(e->p);
  free(e);
}

// ------------------------------------------------ merged configs (gf.cc:1552, 1792)

static uint64_t merged_config_id(filter_t *f) {
  uint64_t parent = f->cfg->id;
  pthread_mutex_lock(&route_mu);
  if (!route.set) {
    pthread_mutex_unlock(&route_mu);
    return parent;
  }
  if (route.merged_id > 0 && route.cached_parent == parent) {
    uint64_t id = route.merged_id;
    pthread_mutex_unlock(&route_mu);
    return id;
  }
  if (route.merged_id > 0) {
    // upper level config changed: destroyed by Go 2 s later (config.go delayDeleteTime)
    so.destroy_cfg(route.merged_id, 1);
  }
  route.merged_id = so.merge_cfg((uint64_t)(uintptr_t)plugin_name, strlen(plugin_name), parent,
                                 route.config_id);
  route.cached_parent = parent;
  uint64_t id = route.merged_id;
  pthread_mutex_unlock(&route_mu);
  return id;
}

// ------------------------------------------------ C API (cgo.cc)

static pstate_t *S(void *s) { return (pstate_t *)s; }

// envoyGoFilterProcessStateHandlerWrapper, cgo.cc:54
#define WITH_STATE(s, body)                                                                        \
  pstate_t *st = S(s);                                                                             \
  if (!in_go(st)) return CAPINotInGo;                                                              \
  filter_t *f = weak_lock(st->r);                                                                  \
  if (!f) return CAPIFilterIsGone;                                                                 \
  CAPIStatus rc_;                                                                                  \
  body;                                                                                            \
  weak_unlock(f);                                                                                  \
  return rc_;

// envoyGoFilterHandlerWrapper, cgo.cc:68
#define WITH_REQ(r, body)                                                                          \
  filter_t *f = weak_lock((req_t *)(r));                                                           \
  if (!f) return CAPIFilterIsGone;                                                                 \
  if (!filter_in_go(f)) {                                                                          \
    weak_unlock(f);                                                                                \
    return CAPINotInGo;                                                                            \
  }                                                                                                \
  CAPIStatus rc_;                                                                                  \
  body;                                                                                            \
  weak_unlock(f);                                                                                  \
  return rc_;

// The common prologue of most Filter:: methods: lock, destroyed, in Go.
static CAPIStatus check_locked(filter_t *f, pstate_t *s) {
  if (f->has_destroyed) return CAPIFilterIsDestroy;
  if (s && !in_go(s)) return CAPINotInGo;
  return CAPIOK;
}

static void posted_continue(filter_t *f, pstate_t *s, void *arg) {
  int status = (int)(intptr_t)arg;
  continue_status_internal(f, s, status);
  maybe_finish(f);
}

static CAPIStatus filter_continue(filter_t *f, pstate_t *s, int status) { // gf.cc:502
  pthread_mutex_lock(&f->mu);
  CAPIStatus rc = check_locked(f, s);
  if (rc == CAPIOK) post_filter(f, s, posted_continue, (void *)(intptr_t)status);
  pthread_mutex_unlock(&f->mu);
  return rc;
}

CAPIStatus envoyGoFilterHttpContinue(void *s, int status) {
  WITH_STATE(s, rc_ = filter_continue(f, st, status));
}

typedef struct {
  int code;
  char *body;
  size_t body_len;
  hmap_t headers;
  char *details;
} lreply_t;

static void free_lreply(filter_t *f, void *a) {
  (void)f;
  lreply_t *l = a;
  free(l->body);
  free(l->details);
  h_free(&l->headers);
  free(l);
}

static void posted_local_reply(filter_t *f, pstate_t *s, void *a) { // sendLocalReplyInternal gf.cc:445
  lreply_t *l = a;
  dodata_clear(s);
  if (s->has_data_buffer) buf_drain(&s->data_buffer, s->data_buffer.len);
  if (!s->is_enc) s->base.state = WaitingHeader; // ps.h:212
  fm_send_local_reply(f, l->code, l->body, l->body_len, &l->headers, l->details);
  free_lreply(f, l);
  maybe_finish(f);
}

static CAPIStatus send_local_reply(filter_t *f, pstate_t *s, lreply_t *l) { // gf.cc:461
  pthread_mutex_lock(&f->mu);
  CAPIStatus rc = check_locked(f, s);
  if (rc == CAPIOK) {
    post_filter(f, s, posted_local_reply, l);
    // The closure is skipped if the filter is gone by then.
  } else {
    free_lreply(f, l);
  }
  pthread_mutex_unlock(&f->mu);
  return rc;
}

CAPIStatus envoyGoFilterHttpSendLocalReply(void *s, int code, void *body, int body_len,
                                           void *headers, int headers_num, long long grpc,
                                           void *details, int details_len) {
  (void)grpc;
  WITH_STATE(s, {
    lreply_t *l = xmalloc(sizeof *l);
    l->code = code;
    l->body = xstrndup(body, (size_t)body_len);
    l->body_len = (size_t)body_len;
    GoString *hs = headers;
    for (int i = 0; i + 1 < headers_num; i += 2)
      h_add(&l->headers, hs[i].p, (size_t)hs[i].n, hs[i + 1].p, (size_t)hs[i + 1].n);
    l->details = xstrndup(details, (size_t)details_len);
    rc_ = send_local_reply(f, st, l);
  });
}

CAPIStatus envoyGoFilterHttpSendPanicReply(void *s, void *details, int details_len) {
  // gf.cc:490: panic_error_ stat, error log, 500 "error happened in filter"
  WITH_STATE(s, {
    fprintf(stderr, "envoyhost: [error] [go_plugin_http][%s] filter paniced with error details: %.*s\n",
            plugin_name, details_len, (const char *)details);
    pthread_mutex_lock(&stats_mu);
    stats[stat_index("golang.panic_error", 18, 0)].value++;
    pthread_mutex_unlock(&stats_mu);
    lreply_t *l = xmalloc(sizeof *l);
    l->code = 500;
    l->body = xstrndup("error happened in filter\r\n", 26);
    l->body_len = 26;
    l->details = xstrndup("", 0);
    rc_ = send_local_reply(f, st, l);
  });
}

typedef struct {
  buf_t data;
  int streaming;
} adddata_t;

static void add_data_now(filter_t *f, pstate_t *s, buf_t *d) {
  // add{De,En}codedData: in headers/trailers callbacks the data goes to the
  // next filter before the trailers (or with the headers' body).
  if (s->is_enc)
    buf_move(&f->enc_added, d);
  else
    buf_move(&f->dec_added, d);
}
static void posted_add_data(filter_t *f, pstate_t *s, void *a) {
  adddata_t *x = a;
  add_data_now(f, s, &x->data);
  buf_free(&x->data);
  free(x);
}

CAPIStatus envoyGoFilterHttpAddData(void *s, void *data, int len, bool streaming) { // gf.cc:530
  WITH_STATE(s, {
    if (st->base.state == ProcessingData) {
      fprintf(stderr, "envoyhost: [error] golang filter calls addData when processing data is not supported\n");
      rc_ = CAPIInvalidPhase;
    } else {
      pthread_mutex_lock(&f->mu);
      rc_ = check_locked(f, st);
      if (rc_ == CAPIOK) {
        if (is_thread(f->w)) {
          buf_t d = {0};
          buf_add(&d, data, (size_t)len);
          add_data_now(f, st, &d);
          buf_free(&d);
        } else {
          adddata_t *x = xmalloc(sizeof *x);
          buf_add(&x->data, data, (size_t)len);
          x->streaming = streaming;
          post_filter(f, st, posted_add_data, x);
          rc_ = CAPIYield;
        }
      }
      pthread_mutex_unlock(&f->mu);
    }
  });
}

static void posted_inject(filter_t *f, pstate_t *s, void *a) {
  buf_t *d = a;
  inject_data(f, s, d, 0);
  buf_free(d);
  free(d);
  maybe_finish(f);
}

CAPIStatus envoyGoFilterHttpInjectData(void *s, void *data, int len) { // gf.cc:570
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    if (rc_ == CAPIOK && st->base.state != ProcessingData) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK && is_thread(f->w)) rc_ = CAPIInvalidScene;
    if (rc_ == CAPIOK) {
      buf_t *d = xmalloc(sizeof *d);
      buf_add(d, data, (size_t)len);
      post_filter(f, st, posted_inject, d);
    }
    pthread_mutex_unlock(&f->mu);
  });
}

CAPIStatus envoyGoFilterHttpGetHeader(void *s, void *key, int key_len, uint64_t *value_data,
                                      int *value_len) { // gf.cc:607
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    if (rc_ == CAPIOK && !st->headers) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK) {
      char *k = xstrndup(key, (size_t)key_len);
      hdr_t *h = h_get(st->headers, k);
      free(k);
      if (h) {
        *value_data = (uint64_t)(uintptr_t)h->v;
        *value_len = (int)h->vl;
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

static void copy_map(hmap_t *m, GoString *strs, char *buf) { // copyHeaderMapToGo gf.cc:633
  int i = 0;
  for (int j = 0; j < m->n; j++) {
    strs[i].n = (ptrdiff_t)m->a[j].kl;
    strs[i].p = buf;
    memcpy(buf, m->a[j].k, m->a[j].kl);
    buf += m->a[j].kl;
    i++;
    strs[i].n = (ptrdiff_t)m->a[j].vl;
    if (m->a[j].vl > 0) {
      strs[i].p = buf;
      memcpy(buf, m->a[j].v, m->a[j].vl);
      buf += m->a[j].vl;
    }
    i++;
  }
}

CAPIStatus envoyGoFilterHttpCopyHeaders(void *s, void *strs, void *buf) { // gf.cc:664
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    if (rc_ == CAPIOK && !st->headers) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK) copy_map(st->headers, strs, buf);
    pthread_mutex_unlock(&f->mu);
  });
}

typedef struct {
  hmap_t *m;
  char *k, *v;
  size_t kl, vl;
  int act; // 0 set, 1 add, 2 remove
} hdrop_t;

static void hdrop_apply(hdrop_t *o) {
  if (o->act == 2)
    h_remove(o->m, o->k, o->kl);
  else if (o->act == 1)
    h_add(o->m, o->k, o->kl, o->v, o->vl);
  else
    h_set(o->m, o->k, o->kl, o->v, o->vl);
}
static void posted_hdrop(filter_t *f, pstate_t *s, void *a) {
  (void)f;
  (void)s;
  hdrop_t *o = a;
  hdrop_apply(o);
  free(o->k);
  free(o->v);
  free(o);
}
static void hdrop_skip(filter_t *f, void *a) {
  (void)f;
  hdrop_t *o = a;
  free(o->k);
  free(o->v);
  free(o);
}

// setHeader/removeHeader/setTrailer/removeTrailer (gf.cc:685..971): direct on
// the worker thread, posted from a goroutine.
static CAPIStatus header_op(filter_t *f, pstate_t *st, int trailers, const char *k, size_t kl,
                            const char *v, size_t vl, int act) {
  pthread_mutex_lock(&f->mu);
  CAPIStatus rc = check_locked(f, st);
  hmap_t *m = trailers ? st->trailers : st->headers;
  if (rc == CAPIOK && !m) rc = CAPIInvalidPhase;
  if (rc == CAPIOK) {
    hdrop_t o = {m, (char *)k, (char *)v, kl, vl, act};
    if (is_thread(f->w)) {
      hdrop_apply(&o);
    } else {
      hdrop_t *c = xmalloc(sizeof *c);
      *c = o;
      c->k = xstrndup(k, kl);
      c->v = v ? xstrndup(v, vl) : NULL;
      posted_t *p = xmalloc(sizeof *p);
      pthread_mutex_lock(&weak_mu);
      f->weak_locks++;
      pthread_mutex_unlock(&weak_mu);
      p->f = f;
      p->s = st;
      p->fn = posted_hdrop;
      p->arg = c;
      p->skip = hdrop_skip;
      post(f->w, run_posted, p);
    }
  }
  pthread_mutex_unlock(&f->mu);
  return rc;
}

CAPIStatus envoyGoFilterHttpSetHeaderHelper(void *s, void *key, int kl, void *value, int vl,
                                            headerAction act) {
  WITH_STATE(s, rc_ = header_op(f, st, 0, key, (size_t)kl, value, (size_t)vl, act == HeaderAdd ? 1 : 0));
}
CAPIStatus envoyGoFilterHttpRemoveHeader(void *s, void *key, int kl) {
  WITH_STATE(s, rc_ = header_op(f, st, 0, key, (size_t)kl, NULL, 0, 2));
}
CAPIStatus envoyGoFilterHttpSetTrailer(void *s, void *key, int kl, void *value, int vl,
                                       headerAction act) {
  WITH_STATE(s, rc_ = header_op(f, st, 1, key, (size_t)kl, value, (size_t)vl, act == HeaderAdd ? 1 : 0));
}
CAPIStatus envoyGoFilterHttpRemoveTrailer(void *s, void *key, int kl) {
  WITH_STATE(s, rc_ = header_op(f, st, 1, key, (size_t)kl, NULL, 0, 2));
}

CAPIStatus envoyGoFilterHttpCopyTrailers(void *s, void *strs, void *buf) { // gf.cc:858
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    if (rc_ == CAPIOK && !st->trailers) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK) copy_map(st->trailers, strs, buf);
    pthread_mutex_unlock(&f->mu);
  });
}

// Buffers: valid only while in the doDataList (gf.cc:787..856).
CAPIStatus envoyGoFilterHttpGetBuffer(void *s, uint64_t buffer, void *data) {
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    buf_t *b = (buf_t *)(uintptr_t)buffer;
    if (rc_ == CAPIOK && !dodata_has(st, b)) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK && b->len) memcpy(data, b->p, b->len);
    pthread_mutex_unlock(&f->mu);
  });
}
CAPIStatus envoyGoFilterHttpDrainBuffer(void *s, uint64_t buffer, uint64_t length) {
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    buf_t *b = (buf_t *)(uintptr_t)buffer;
    if (rc_ == CAPIOK && !dodata_has(st, b)) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK) buf_drain(b, length);
    pthread_mutex_unlock(&f->mu);
  });
}
CAPIStatus envoyGoFilterHttpSetBufferHelper(void *s, uint64_t buffer, void *data, int length,
                                            bufferAction action) {
  WITH_STATE(s, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    buf_t *b = (buf_t *)(uintptr_t)buffer;
    if (rc_ == CAPIOK && !dodata_has(st, b)) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK) {
      if (action == Set) {
        b->len = 0;
        buf_add(b, data, (size_t)length);
      } else if (action == Prepend) {
        buf_prepend(b, data, (size_t)length);
      } else {
        buf_add(b, data, (size_t)length);
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

// parseAuthority(host).is_ip_address_ (source/common/http/utility.cc).
static int is_ip_authority(const char *h, size_t n) {
  char tmp[128];
  if (n == 0 || n >= sizeof tmp) return 0;
  memcpy(tmp, h, n);
  tmp[n] = 0;
  char *host = tmp;
  if (tmp[0] == '[') {
    char *e = strchr(tmp, ']');
    if (!e) return 0;
    *e = 0;
    host = tmp + 1;
    struct in6_addr a6;
    return inet_pton(AF_INET6, host, &a6) == 1;
  }
  char *colon = strrchr(tmp, ':');
  if (colon && strchr(tmp, ':') == colon) *colon = 0; // host:port; more colons: bare IPv6
  struct in_addr a4;
  struct in6_addr a6;
  return inet_pton(AF_INET, host, &a4) == 1 || inet_pton(AF_INET6, host, &a6) == 1;
}

static void posted_override(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  free(f->override_host);
  f->override_host = a;
  f->override_strict = 0; // gf.cc:1012: the posted override is always non-strict
}

CAPIStatus envoyGoFilterHttpSetUpstreamOverrideHost(void *s, void *host, int len, bool strict) {
  WITH_STATE(s, { // gf.cc:973
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, st);
    if (rc_ == CAPIOK && st->is_enc) rc_ = CAPIInvalidPhase;
    if (rc_ == CAPIOK && !is_ip_authority(host, (size_t)len)) rc_ = CAPIInvalidIPAddress;
    if (rc_ == CAPIOK) {
      if (is_thread(f->w)) {
        free(f->override_host);
        f->override_host = xstrndup(host, (size_t)len);
        f->override_strict = strict;
      } else {
        post_filter(f, st, posted_override, xstrndup(host, (size_t)len));
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

static void clear_route_cache_internal(filter_t *f, int refresh) { // gf.cc:1044
  f->route_cached = 0;
  if (refresh) route_snapshot(f);
}
static void posted_clear_route(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  clear_route_cache_internal(f, (int)(intptr_t)a);
}

CAPIStatus envoyGoFilterHttpClearRouteCache(void *r, bool refresh) { // gf.cc:1022
  WITH_REQ(r, {
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      if (is_thread(f->w))
        clear_route_cache_internal(f, refresh);
      else
        post_filter(f, &f->req->dec, posted_clear_route, (void *)(intptr_t)refresh);
    }
    pthread_mutex_unlock(&f->mu);
  });
}

static void set_str_value(req_t *r, const char *s, size_t n) {
  free(r->str_value);
  r->str_value = xstrndup(s, n);
  r->str_len = n;
}

CAPIStatus envoyGoFilterHttpGetStringValue(void *r, int id, uint64_t *value_data, int *value_len) {
  WITH_REQ(r, { // gf.cc:1087
    req_t *rq = r;
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      const char *v = NULL;
      switch (id) {
      case 1: v = "llm-route"; break;             // RouteName
      case 2: v = ""; break;                      // FilterChainName
      case 5: v = f->details; if (!v) rc_ = CAPIValueNotFound; break; // ResponseCodeDetails
      case 7: v = "127.0.0.1:10000"; break;       // DownstreamLocalAddress
      case 8: v = "127.0.0.1:1"; break;           // DownstreamRemoteAddress
      case 9: v = f->upstream_host ? "127.0.0.1:0" : NULL; if (!v) rc_ = CAPIValueNotFound; break;
      case 10: v = f->upstream_host; if (!v) rc_ = CAPIValueNotFound; break; // UpstreamRemoteAddress
      case 11: v = f->cluster; if (!v) rc_ = CAPIValueNotFound; break;       // UpstreamClusterName
      case 12: rc_ = CAPIValueNotFound; break;    // VirtualClusterName
      default: die("invalid string value id: %d", id); // RELEASE_ASSERT
      }
      if (rc_ == CAPIOK) {
        set_str_value(rq, v, strlen(v));
        *value_data = (uint64_t)(uintptr_t)rq->str_value;
        *value_len = (int)rq->str_len;
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

CAPIStatus envoyGoFilterHttpGetIntegerValue(void *r, int id, uint64_t *value) {
  WITH_REQ(r, { // gf.cc:1054
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      switch (id) {
      case 3: *value = 1; break; // Protocol: HTTP/1.1
      case 4: if (f->response_code) *value = (uint64_t)f->response_code; else rc_ = CAPIValueNotFound; break;
      case 6: *value = (uint64_t)f->attempts; break;
      default: die("invalid integer value id: %d", id);
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

// Dynamic metadata: a Struct per filter name; setDynamicMetadata merges one
// key (gf.cc:1226). Serialized by hand: Struct{map<string,Value> fields=1}.
static void varint(buf_t *b, uint64_t v) {
  while (v >= 0x80) {
    uint8_t c = (uint8_t)(v | 0x80);
    buf_add(b, &c, 1);
    v >>= 7;
  }
  uint8_t c = (uint8_t)v;
  buf_add(b, &c, 1);
}
static void serialize_struct(hmap_t *kv, buf_t *out) {
  out->len = 0;
  for (int i = 0; i < kv->n; i++) {
    buf_t entry = {0};
    varint(&entry, (1 << 3) | 2);
    varint(&entry, kv->a[i].kl);
    buf_add(&entry, kv->a[i].k, kv->a[i].kl);
    varint(&entry, (2 << 3) | 2);
    varint(&entry, kv->a[i].vl);
    buf_add(&entry, kv->a[i].v, kv->a[i].vl);
    varint(out, (1 << 3) | 2);
    varint(out, entry.len);
    buf_add(out, entry.p, entry.len);
    buf_free(&entry);
  }
}
static dynmeta_t *meta_for(filter_t *f, const char *name, size_t n, int create) {
  for (int i = 0; i < f->nmeta; i++)
    if (strlen(f->meta[i].name) == n && !memcmp(f->meta[i].name, name, n)) return &f->meta[i];
  if (!create || f->nmeta == 8) return NULL;
  dynmeta_t *m = &f->meta[f->nmeta++];
  m->name = xstrndup(name, n);
  return m;
}

typedef struct {
  char *name, *key, *val;
  size_t nl, kl, vl;
  uint64_t *out_data;
  int *out_len;
  int *rc;
} metaop_t;

static void meta_populate(filter_t *f, metaop_t *o) { // populateSliceWithMetadata gf.cc:1185
  dynmeta_t *m = meta_for(f, o->name, o->nl, 0);
  if (m) {
    serialize_struct(&m->kv, &m->fields);
    set_str_value(f->req, m->fields.p ? m->fields.p : "", m->fields.len);
    *o->out_data = (uint64_t)(uintptr_t)f->req->str_value;
    *o->out_len = (int)f->req->str_len;
  }
}
static void posted_meta_get(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  metaop_t *o = a;
  meta_populate(f, o);
  so.sema_dec(&f->req->base);
  free(o->name);
  free(o);
}
static void posted_meta_set(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  metaop_t *o = a;
  dynmeta_t *m = meta_for(f, o->name, o->nl, 1);
  if (m) h_set(&m->kv, o->key, o->kl, o->val, o->vl);
  free(o->name);
  free(o->key);
  free(o->val);
  free(o);
}

CAPIStatus envoyGoFilterHttpGetDynamicMetadata(void *r, void *name, int nl, uint64_t *data, int *len) {
  WITH_REQ(r, { // gf.cc:1156
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      metaop_t *o = xmalloc(sizeof *o);
      o->name = xstrndup(name, (size_t)nl);
      o->nl = (size_t)nl;
      o->out_data = data;
      o->out_len = len;
      if (!is_thread(f->w)) {
        post_filter(f, &f->req->dec, posted_meta_get, o);
        rc_ = CAPIYield;
      } else {
        meta_populate(f, o);
        free(o->name);
        free(o);
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

CAPIStatus envoyGoFilterHttpSetDynamicMetadata(void *r, void *name, int nl, void *key, int kl,
                                               void *buf, int bl) {
  WITH_REQ(r, { // gf.cc:1196
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      metaop_t *o = xmalloc(sizeof *o);
      o->name = xstrndup(name, (size_t)nl);
      o->nl = (size_t)nl;
      o->key = xstrndup(key, (size_t)kl);
      o->kl = (size_t)kl;
      o->val = xstrndup(buf, (size_t)bl);
      o->vl = (size_t)bl;
      if (!is_thread(f->w))
        post_filter(f, &f->req->dec, posted_meta_set, o);
      else
        posted_meta_set(f, NULL, o);
    }
    pthread_mutex_unlock(&f->mu);
  });
}

// Finalize from Go's GC (cgo.cc:303): deferred delete while the filter lives.
static void req_deferred_free(void *a) {
  req_t *r = a;
  pthread_mutex_lock(&weak_mu);
  filter_t *f = r->filter;
  r->freed_by_go = 1;
  int free_f = 0;
  if (f) {
    f->req_gone = 1;
    free_f = f->dead && f->weak_locks == 0;
  }
  pthread_mutex_unlock(&weak_mu);
  req_free(r);
  if (free_f) filter_free(f);
}

void envoyGoFilterHttpFinalize(void *r, int reason) {
  (void)reason;
  atomic_fetch_add(&requests_finalized, 1);
  req_t *rq = r;
  filter_t *f = weak_lock(rq);
  if (f) {
    post(f->w, req_deferred_free, rq);
    weak_unlock(f);
  } else {
    req_deferred_free(rq);
  }
}

void envoyGoConfigHttpFinalize(void *c) { // cgo.cc:323
  atomic_fetch_add(&configs_finalized, 1);
  pthread_mutex_lock(&cfg_mu);
  hconfig_t *h = c;
  if (h->weak) h->weak->h = NULL;
  pthread_mutex_unlock(&cfg_mu);
  free(h);
}

static void posted_fs_set(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  metaop_t *o = a;
  h_set(&f->filter_state, o->key, o->kl, o->val, o->vl);
  free(o->key);
  free(o->val);
  free(o);
}
CAPIStatus envoyGoFilterHttpSetStringFilterState(void *r, void *key, int kl, void *value, int vl,
                                                 int state_type, int life_span, int sharing) {
  (void)state_type;
  (void)life_span;
  (void)sharing;
  WITH_REQ(r, { // gf.cc:1237
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      metaop_t *o = xmalloc(sizeof *o);
      o->key = xstrndup(key, (size_t)kl);
      o->kl = (size_t)kl;
      o->val = xstrndup(value, (size_t)vl);
      o->vl = (size_t)vl;
      if (is_thread(f->w))
        posted_fs_set(f, NULL, o);
      else
        post_filter(f, &f->req->dec, posted_fs_set, o);
    }
    pthread_mutex_unlock(&f->mu);
  });
}

static void fs_get(filter_t *f, metaop_t *o) {
  char *k = xstrndup(o->key, o->kl);
  hdr_t *h = h_get(&f->filter_state, k);
  free(k);
  if (h) {
    set_str_value(f->req, h->v, h->vl);
    *o->out_data = (uint64_t)(uintptr_t)f->req->str_value;
    *o->out_len = (int)f->req->str_len;
  }
}
static void posted_fs_get(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  metaop_t *o = a;
  fs_get(f, o);
  so.sema_dec(&f->req->base);
  free(o->key);
  free(o);
}
CAPIStatus envoyGoFilterHttpGetStringFilterState(void *r, void *key, int kl, uint64_t *data, int *len) {
  WITH_REQ(r, { // gf.cc:1271
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      metaop_t *o = xmalloc(sizeof *o);
      o->key = xstrndup(key, (size_t)kl);
      o->kl = (size_t)kl;
      o->out_data = data;
      o->out_len = len;
      if (is_thread(f->w)) {
        fs_get(f, o);
        free(o->key);
        free(o);
      } else {
        post_filter(f, &f->req->dec, posted_fs_get, o);
        rc_ = CAPIYield;
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

// A few CEL attributes (gf.cc:1356 walks Envoy's attribute tree).
static CAPIStatus property(filter_t *f, const char *path, size_t n) {
  const char *v = NULL;
  char tmp[64];
  hdr_t *h;
  if (n == 12 && !memcmp(path, "request.path", n)) {
    h = h_get(&f->req_headers, ":path");
    v = h ? h->v : NULL;
  } else if (n == 14 && !memcmp(path, "request.method", n)) {
    h = h_get(&f->req_headers, ":method");
    v = h ? h->v : NULL;
  } else if (n == 10 && !memcmp(path, "request.id", n)) {
    h = h_get(&f->req_headers, "x-request-id");
    v = h ? h->v : NULL;
  } else if (n == 16 && !memcmp(path, "upstream.address", n)) {
    v = f->upstream_host;
  } else if (n == 13 && !memcmp(path, "response.code", n) && f->response_code) {
    snprintf(tmp, sizeof tmp, "%d", f->response_code);
    v = tmp;
  } else if (n == 17 && !memcmp(path, "xds.cluster_name", n)) {
    v = f->cluster;
  }
  if (!v) return CAPIValueNotFound;
  set_str_value(f->req, v, strlen(v));
  return CAPIOK;
}
typedef struct {
  char *path;
  size_t n;
  uint64_t *data;
  int *len, *rc;
} propop_t;
static void posted_prop(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  propop_t *o = a;
  *o->rc = property(f, o->path, o->n);
  if (*o->rc == CAPIOK) {
    *o->data = (uint64_t)(uintptr_t)f->req->str_value;
    *o->len = (int)f->req->str_len;
  }
  so.sema_dec(&f->req->base);
  free(o->path);
  free(o);
}
CAPIStatus envoyGoFilterHttpGetStringProperty(void *r, void *key, int kl, uint64_t *data, int *len,
                                              int *rc) {
  WITH_REQ(r, { // gf.cc:1309
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      if (is_thread(f->w)) {
        rc_ = property(f, key, (size_t)kl);
        if (rc_ == CAPIOK) {
          *data = (uint64_t)(uintptr_t)f->req->str_value;
          *len = (int)f->req->str_len;
        }
      } else {
        propop_t *o = xmalloc(sizeof *o);
        o->path = xstrndup(key, (size_t)kl);
        o->n = (size_t)kl;
        o->data = data;
        o->len = len;
        o->rc = rc;
        post_filter(f, &f->req->dec, posted_prop, o);
        rc_ = CAPIYield;
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

static void posted_secret(filter_t *f, pstate_t *s, void *a) {
  (void)s;
  int *len = a;
  *len = -1;
  so.sema_dec(&f->req->base);
}
CAPIStatus envoyGoFilterHttpGetStringSecret(void *r, void *key, int kl, uint64_t *data, int *len) {
  (void)key;
  (void)kl;
  (void)data;
  WITH_REQ(r, { // gf.cc:1509: no generic_secrets configured: not found
    pthread_mutex_lock(&f->mu);
    rc_ = check_locked(f, NULL);
    if (rc_ == CAPIOK) {
      if (is_thread(f->w)) {
        *len = -1;
      } else {
        post_filter(f, &f->req->dec, posted_secret, len);
        rc_ = CAPIYield;
      }
    }
    pthread_mutex_unlock(&f->mu);
  });
}

static const char *level_names[] = {"trace", "debug", "info", "warning", "error", "critical"};

void envoyGoFilterLog(uint32_t level, void *msg, int len) {
  if (level < log_level) return;
  fprintf(stderr, "[%s][golang] %.*s\n", level < 6 ? level_names[level] : "?", len, (const char *)msg);
}
uint32_t envoyGoFilterLogLevel(void) { return log_level; }

// Metrics go through the config's weak_ptr (cgo.cc:84): CAPIFilterIsGone
// once the FilterConfig is being destroyed.
CAPIStatus envoyGoFilterHttpDefineMetric(void *c, uint32_t type, void *name, int n, uint32_t *id) {
  fconfig_t *fc = cfg_lock_weak(c);
  if (!fc) return CAPIFilterIsGone;
  CAPIStatus rc = CAPIOK;
  if (type > 2) {
    rc = CAPIValueNotFound;
  } else {
    pthread_mutex_lock(&stats_mu);
    int idx = stat_index(name, (size_t)n, (int)type);
    pthread_mutex_unlock(&stats_mu);
    pthread_mutex_lock(&fc->mu);
    fc->metric_ids[fc->nmetrics] = idx;
    *id = ((uint32_t)fc->nmetrics << 2) | type;
    fc->nmetrics++;
    pthread_mutex_unlock(&fc->mu);
  }
  cfg_release(fc, 0);
  return rc;
}

static CAPIStatus metric_op(void *c, uint32_t id, int op, int64_t v, uint64_t *out) {
  fconfig_t *fc = cfg_lock_weak(c);
  if (!fc) return CAPIFilterIsGone;
  uint32_t i = id >> 2;
  pthread_mutex_lock(&fc->mu);
  int known = (int)i < fc->nmetrics;
  int idx = known ? fc->metric_ids[i] : 0;
  pthread_mutex_unlock(&fc->mu);
  if (known) {
    pthread_mutex_lock(&stats_mu);
    int type = (int)(id & 3);
    if (op == 0) { // increment (gf.cc:1646): counters ignore negative offsets
      if (type == 1 || v > 0) stats[idx].value += v;
    } else if (op == 1) {
      *out = (uint64_t)stats[idx].value;
    } else { // recordMetric (gf.cc:1686): gauge set, counter add, histogram recordValue
      if (type == 1)
        stats[idx].value = v;
      else
        stats[idx].value += v;
      if (type == 2) stats[idx].count++;
    }
    pthread_mutex_unlock(&stats_mu);
  }
  cfg_release(fc, 1);
  return CAPIOK;
}
CAPIStatus envoyGoFilterHttpIncrementMetric(void *c, uint32_t id, int64_t offset) {
  return metric_op(c, id, 0, offset, NULL);
}
CAPIStatus envoyGoFilterHttpGetMetric(void *c, uint32_t id, uint64_t *value) {
  return metric_op(c, id, 1, 0, value);
}
CAPIStatus envoyGoFilterHttpRecordMetric(void *c, uint32_t id, uint64_t value) {
  return metric_op(c, id, 2, (int64_t)value, NULL);
}

// ---------------------------------------------------------------- main thread

static void push_config(uint64_t rid, const char *p, size_t n) { // FilterConfig::newGoPluginConfig gf.cc:1580
  fconfig_t *c = xmalloc(sizeof *c);
  pthread_mutex_init(&c->mu, NULL);
  c->buf = xstrndup(p, n);
  c->buf_len = n;
  hconfig_t *h = xmalloc(sizeof *h);
  h->weak = c;
  c->h = h;
  c->refs = 1;
  h->base.plugin_name_ptr = (uint64_t)(uintptr_t)plugin_name;
  h->base.plugin_name_len = strlen(plugin_name);
  h->base.config_ptr = (uint64_t)(uintptr_t)c->buf;
  h->base.config_len = n;
  h->base.is_route_config = 0;
  h->base.concurrency = concurrency;
  c->id = so.new_cfg(&h->base);
  buf_t out = {0};
  put_u64(&out, c->id);
  if (c->id == 0) {
    // Envoy rejects the listener update; the old config stays.
    pthread_mutex_lock(&cfg_mu);
    c->refs = 0;
    c->h->weak = NULL;
    pthread_mutex_unlock(&cfg_mu);
    free(c->buf);
    free(c);
  } else {
    pthread_mutex_lock(&cfg_mu);
    fconfig_t *old = current_cfg;
    current_cfg = c;
    pthread_mutex_unlock(&cfg_mu);
    if (old) cfg_release(old, 0);
  }
  send_frame(F_CFG_PUSHED, rid, &out);
  buf_free(&out);
}

static void drop_config(uint64_t rid) { // listener removed
  pthread_mutex_lock(&cfg_mu);
  fconfig_t *old = current_cfg;
  current_cfg = NULL;
  pthread_mutex_unlock(&cfg_mu);
  if (old) cfg_release(old, 0);
  send_frame(F_CFG_PUSHED, rid, NULL);
}

static void set_route_config(uint64_t rid, const char *p, size_t n) {
  pthread_mutex_lock(&route_mu);
  // ~RoutePluginConfig (gf.cc:1762): the old route config and its merge.
  if (route.set) {
    if (route.config_id) so.destroy_cfg(route.config_id, 0);
    if (route.merged_id && route.merged_id != route.config_id) so.destroy_cfg(route.merged_id, 0);
    free(route.buf);
    memset(&route, 0, sizeof route);
  }
  uint64_t id = 0;
  if (n > 0) {
    route.buf = xstrndup(p, n);
    route.buf_len = n;
    route.cfg.plugin_name_ptr = (uint64_t)(uintptr_t)plugin_name;
    route.cfg.plugin_name_len = strlen(plugin_name);
    route.cfg.config_ptr = (uint64_t)(uintptr_t)route.buf;
    route.cfg.config_len = n;
    route.cfg.is_route_config = 1;
    route.cfg.concurrency = concurrency;
    id = so.new_cfg(&route.cfg);
    if (id) {
      route.set = 1;
      route.config_id = id;
    } else {
      free(route.buf);
      memset(&route, 0, sizeof route);
    }
  }
  pthread_mutex_unlock(&route_mu);
  buf_t out = {0};
  put_u64(&out, id);
  send_frame(F_ROUTE_SET, rid, &out);
  buf_free(&out);
}

static void dump_metrics(uint64_t rid) {
  buf_t out = {0};
  pthread_mutex_lock(&stats_mu);
  for (int i = 0; i < nstats; i++) {
    char line[1024];
    int n;
    if (stats[i].type == 2)
      n = snprintf(line, sizeof line, "%s:count %ld\n%s:sum %ld\n", stats[i].name, (long)stats[i].count,
                   stats[i].name, (long)stats[i].value);
    else
      n = snprintf(line, sizeof line, "%s %ld\n", stats[i].name, (long)stats[i].value);
    if (n >= (int)sizeof line) n = (int)sizeof line - 1;
    buf_add(&out, line, (size_t)n);
  }
  pthread_mutex_unlock(&stats_mu);
  char line[256];
  int n = snprintf(line, sizeof line,
                   "envoyhost.requests_in_go %ld\nenvoyhost.requests_finalized %ld\nenvoyhost.configs_finalized %ld\n",
                   atomic_load(&requests_in_go), atomic_load(&requests_finalized),
                   atomic_load(&configs_finalized));
  buf_add(&out, line, (size_t)n);
  send_frame(F_METRICS_OUT, rid, &out);
  buf_free(&out);
}

static int read_full(int fd, void *p, size_t n) {
  size_t off = 0;
  while (off < n) {
    ssize_t r = read(fd, (char *)p + off, n - off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return 0;
    off += (size_t)r;
  }
  return 1;
}

// envoyGoFilterCleanUp: Envoy's ASan tests use it to force a GC cycle and
// wait for the finalizers; tests here, to check the finalizer path.
static void (*cleanup)(void);

int main(int argc, char **argv) {
  const char *so_path = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--so") && i + 1 < argc)
      so_path = argv[++i];
    else if (!strcmp(argv[i], "--concurrency") && i + 1 < argc)
      concurrency = (uint32_t)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--log-level") && i + 1 < argc)
      log_level = (uint32_t)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--buffer-limit") && i + 1 < argc)
      decoder_limit = encoder_limit = (uint64_t)atoll(argv[++i]);
    else
      die("usage: envoyhost --so PATH [--concurrency N] [--log-level 0-5] [--buffer-limit BYTES]");
  }
  if (!so_path || concurrency == 0) die("--so is required, --concurrency must be > 0");
  setvbuf(stderr, NULL, _IOLBF, 0);
  // Frames to the driver leave on a private copy of stdout; fd 1 becomes
  // stderr, so whatever the library prints on stdout (as it may in Envoy,
  // whose access log goes there) cannot corrupt the frame stream.
  frame_fd = dup(1);
  if (frame_fd < 0 || dup2(2, 1) < 0) die("cannot set up the frame pipe");
  // Dso::DsoManager loads with RTLD_LAZY|RTLD_LOCAL in Envoy; RTLD_NOW here
  // so a missing C function fails at load, not mid-request.
  void *h = dlopen(so_path, RTLD_NOW | RTLD_LOCAL);
  if (!h) die("dlopen %s: %s", so_path, dlerror());
#define SYM(field, name)                                                                           \
  so.field = dlsym(h, name);                                                                       \
  if (!so.field) die("%s does not export %s", so_path, name);
  SYM(new_cfg, "envoyGoFilterNewHttpPluginConfig");
  SYM(merge_cfg, "envoyGoFilterMergeHttpPluginConfig");
  SYM(destroy_cfg, "envoyGoFilterDestroyHttpPluginConfig");
  SYM(on_header, "envoyGoFilterOnHttpHeader");
  SYM(on_data, "envoyGoFilterOnHttpData");
  SYM(on_log, "envoyGoFilterOnHttpLog");
  SYM(on_stream_complete, "envoyGoFilterOnHttpStreamComplete");
  SYM(on_destroy, "envoyGoFilterOnHttpDestroy");
  SYM(sema_dec, "envoyGoRequestSemaDec");
  cleanup = (void (*)(void))dlsym(h, "envoyGoFilterCleanUp");
  if (!cleanup) die("%s does not export envoyGoFilterCleanUp", so_path);

  workers = xmalloc(sizeof(worker_t) * concurrency);
  tables = xmalloc(sizeof(stable_t) * concurrency);
  for (uint32_t i = 0; i < concurrency; i++) {
    workers[i].id = i;
    pthread_mutex_init(&workers[i].mu, NULL);
    pthread_cond_init(&workers[i].cv, NULL);
    if (pthread_create(&workers[i].tid, NULL, worker_loop, &workers[i])) die("pthread_create");
  }
  fprintf(stderr, "envoyhost: loaded %s, concurrency %u\n", so_path, concurrency);

  for (;;) {
    uint32_t len;
    if (!read_full(0, &len, 4)) break;
    if (len < 9) die("bad frame length %u", len);
    char *p = xmalloc(len);
    if (!read_full(0, p, len)) break;
    uint8_t type = (uint8_t)p[0];
    uint64_t id;
    memcpy(&id, p + 1, 8);
    const char *pl = p + 9;
    size_t pn = len - 9;
    switch (type) {
    case F_CFG_PUSH:
      push_config(id, pl, pn);
      free(p);
      break;
    case F_CFG_DROP:
      drop_config(id);
      free(p);
      break;
    case F_ROUTE_CFG:
      set_route_config(id, pl, pn);
      free(p);
      break;
    case F_METRICS:
      dump_metrics(id);
      free(p);
      break;
    case F_LOCAL_REPLY_CFG:
      set_local_reply(id, pl, pn);
      free(p);
      break;
    case F_GC:
      cleanup();
      send_frame(F_GC_DONE, id, NULL);
      free(p);
      break;
    case F_SHUTDOWN:
      drop_config(id);
      set_route_config(0, NULL, 0);
      send_frame(F_BYE, id, NULL);
      free(p);
      return 0;
    case F_REQ_HEADERS:
    case F_REQ_DATA:
    case F_REQ_TRAILERS:
    case F_RESP_HEADERS:
    case F_RESP_DATA:
    case F_RESP_TRAILERS:
    case F_RESET: {
      // The stream id carries the connection's worker (a connection is
      // owned by one worker thread for its life).
      if (pn < 4) die("stream frame without worker");
      uint32_t conn;
      memcpy(&conn, pl, 4);
      ev_t *e = xmalloc(sizeof *e);
      e->type = type;
      e->sid = id;
      e->w = &workers[conn % concurrency];
      e->len = pn - 4;
      e->p = xmalloc(e->len);
      memcpy(e->p, pl + 4, e->len);
      free(p);
      post(e->w, on_event, e);
      break;
    }
    default:
      die("unknown frame type %u", type);
    }
  }
  fprintf(stderr, "envoyhost: driver closed stdin, exiting\n");
  return 0;
}
