"""A minimal rate limit service for Envoy's global rate limit filter (`envoy.filters.http.ratelimit`),
for the benchmark only: envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit over gRPC
(grpcio with a generic handler on raw bytes and a hand-written protobuf codec for the few fields
it needs), counting as envoyproxy/ratelimit does: one counter per descriptor per fixed window,
`counter += hits`, over the limit when the counter after adding exceeds the limit.

Hits: a descriptor's `hits_addend` when it has one (also 0), else the request's `hits_addend`,
else 1. A call with 0 hits only checks; it is refused when the counter has reached the limit
(`counter >= limit`). envoyproxy/ratelimit refuses it only past the limit (`counter > limit`), so
this is the stricter of the two by one exactly spent budget: a key whose budget is spent to the
token is refused here. The window starts when the service starts (envoyproxy/ratelimit aligns
windows to the clock, so a run that crosses a window's end would see its counter reset and admit
a new wave: here a run shorter than the window never does). These are the choices that give
the native setup its lowest overshoot.
"""
import argparse
import threading
import time
from concurrent import futures

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
OK, OVER_LIMIT = 1, 2


# ---------------------------------------------------------------- protobuf, by hand

def _varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf):
    """(field number, wire type, value) of a message: varints as ints, length-delimited as bytes."""
    i, out = 0, []
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            length, i = _varint(buf, i)
            value, i = bytes(buf[i:i + length]), i + length
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire}")
        out.append((number, wire, value))
    return out


def decode_request(buf):
    """RateLimitRequest: domain = 1, descriptors = 2 (entries = 1 {key = 1, value = 2},
    hits_addend = 3 google.protobuf.UInt64Value {value = 1}), hits_addend = 3 (uint32).
    Returns (domain, [(((key, value), ...), hits or None)], request hits)."""
    domain, descriptors, hits = "", [], 0
    for number, wire, value in _fields(buf):
        if number == 1 and wire == 2:
            domain = value.decode()
        elif number == 2 and wire == 2:
            entries, d_hits = [], None
            for n, w, v in _fields(value):
                if n == 1 and w == 2:
                    kv = {k: x.decode() for k, wt, x in _fields(v) if wt == 2}
                    entries.append((kv.get(1, ""), kv.get(2, "")))
                elif n == 3 and w == 2:  # present: its value, 0 when the wrapper is empty
                    d_hits = next((x for k, wt, x in _fields(v) if k == 1 and wt == 0), 0)
            descriptors.append((tuple(entries), d_hits))
        elif number == 3 and wire == 0:
            hits = value
    return domain, descriptors, hits


def encode_response(code):
    """RateLimitResponse with its overall_code (field 1, enum) only."""
    return bytes([0x08, code])


# ---------------------------------------------------------------- the service

class RateLimitService:
    """Serves on 127.0.0.1:`port`: `limit` per descriptor per fixed window of `window_s` seconds."""

    def __init__(self, port, limit, window_s=60.0, redis_url=None, workers=4):
        try:
            import grpc
        except ImportError:
            raise RuntimeError("grpcio is missing: `.venv/bin/pip install grpcio` (`make bench` installs it)")
        self.limit, self.window_s = limit, window_s
        self.start = time.monotonic()
        self.counters = {}
        self.lock = threading.Lock()
        # With Redis, as envoyproxy/ratelimit's Redis cache does: per descriptor, a pipeline of
        # INCRBY by the hits and EXPIRE for the window, its keys named by the window's start.
        self.redis = None
        if redis_url:
            import redis
            self.redis = redis.Redis.from_url(redis_url)
        self.calls = []  # (seconds since start, descriptor key, hits, counter after, code)
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "ShouldRateLimit": grpc.unary_unary_rpc_method_handler(self.should_rate_limit)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def should_rate_limit(self, request, _context):
        domain, descriptors, request_hits = decode_request(request)
        now = time.monotonic() - self.start
        window = int(now // self.window_s)
        code = OK
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            counted = []
            for entries, d_hits in descriptors:
                hits = d_hits if d_hits is not None else (request_hits or 1)
                key = f"{domain}_" + "_".join(f"{k}_{v}" for k, v in entries) + f"_{window}"
                pipe.incrby(key, hits)
                pipe.expire(key, int(self.window_s) + 1)
                counted.append(hits)
            results = pipe.execute()
            for i, hits in enumerate(counted):
                counter = results[2 * i]
                if (counter >= self.limit) if hits == 0 else (counter > self.limit):
                    code = OVER_LIMIT
            with self.lock:
                self.calls.append((now, (), sum(counted), 0, code))
            return encode_response(code)
        with self.lock:
            for entries, d_hits in descriptors:
                hits = d_hits if d_hits is not None else (request_hits or 1)
                key = (domain, entries, window)
                counter = self.counters.get(key, 0) + hits
                self.counters[key] = counter
                over = counter >= self.limit if hits == 0 else counter > self.limit
                if over:
                    code = OVER_LIMIT
                self.calls.append((now, entries, hits, counter, code))
        return encode_response(code)

    def stop(self):
        self.server.stop(0)


if __name__ == "__main__":
    # A process of its own (the benchmark measures its CPU apart):
    # rls.py --port P --limit N --window S [--redis redis://…]
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--limit", type=int, required=True)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--redis")
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args()
    service = RateLimitService(a.port, a.limit, a.window, a.redis, a.workers)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        service.stop()
