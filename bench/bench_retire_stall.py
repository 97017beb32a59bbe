# bench_retire_stall.py - decode inter-token gaps of 16 streams while long chat
# conversations retire (issue 9 item 4: the render prediction of a retiring
# checkpoint-tier request used to run on the engine thread).
#
# Usage: python3 bench/bench_retire_stall.py PORT SECONDS   (against a running
# `ember serve` of a checkpoint-tier model; `make bench-retire-stall` starts one).
# 16 clients stream 64-token completions back to back; one client resends a
# ~6k-token chat conversation (a warm ckpt hit, then a retirement whose store is
# keyed on the next-turn prediction) every 0.2 s. Prints the p50/p90/p99/max
# gap between streamed tokens, the tokens streamed and the retirements done.
import http.client, json, sys, threading, time, random
port, secs = int(sys.argv[1]), float(sys.argv[2])
stop = time.time() + secs
gaps, lock = [], threading.Lock()
stalls = [0]
def stream(i):
    while time.time() < stop:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = json.dumps({"prompt": [100 + i, 200 + i, 300, 400], "max_tokens": 64, "stream": True,
                           "ignore_eos": True, "temperature": 0, "cache_salt": "s%d" % i})
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse(); last = None
        while True:
            try:
                line = r.fp.readline()
            except Exception:
                with lock: stalls[0] += 1
                break
            if not line or line.startswith(b"data: [DONE]"): break
            if line.startswith(b"data: {"):
                now = time.time()
                if last is not None:
                    with lock: gaps.append(now - last)
                last = now
        c.close()
random.seed(1)
words = ["ka", "ro", "mi", "the", "an", "de", "lu", "ser", "in", "to", "ve"]
def text(n): return " ".join(random.choice(words) + random.choice(words) for _ in range(n))
conv = [{"role": "system", "content": text(300)}]
for t in range(4):
    conv.append({"role": "user", "content": text(300)})
    conv.append({"role": "assistant", "content": text(300)})
conv.append({"role": "user", "content": text(200)})
retires = [0]
def chatter():
    while time.time() < stop:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/chat/completions", json.dumps({"messages": conv, "max_tokens": 2, "temperature": 0}),
                  {"Content-Type": "application/json"})
        r = json.loads(c.getresponse().read()); c.close()
        retires[0] += 1
        time.sleep(0.2)
        if retires[0] == 1: print("chat prompt tokens", r["usage"]["prompt_tokens"], file=sys.stderr)
th = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
th.append(threading.Thread(target=chatter))
# warm the conversation first (its first prefill is long)
c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
c.request("POST", "/v1/chat/completions", json.dumps({"messages": conv, "max_tokens": 2, "temperature": 0}),
          {"Content-Type": "application/json"}); c.getresponse().read(); c.close()
stop = time.time() + secs
for t in th: t.start()
for t in th: t.join()
g = sorted(gaps)
p = lambda q: 1e3 * g[min(len(g) - 1, int(q * len(g)))]
print("stream reads that timed out (30 s): %d" % stalls[0])
print("gaps %d  p50 %.1f ms  p90 %.1f ms  p99 %.1f ms  max %.1f ms  chat retirements %d" % (len(g), p(.5), p(.9), p(.99), 1e3 * g[-1], retires[0]))
