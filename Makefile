# Thin wrapper over CMake. `make run` builds ember and serves the default
# model (models/stories260K.gguf, a trained TinyStories model shipped in the
# repository) over the OpenAI API (ember's main job); `make generate` runs
# one prompt through it instead; `make test` builds three times (optimized,
# with ASan+UBSan, and with ThreadSanitizer), runs every test in the first two
# builds and the server and cache tests in the third; `make install
# PREFIX=/opt/ember` installs the binary and its man page; `make docs`
# regenerates docs/cache-switches.md from the settings table.
JOBS ?= $(shell nproc)
PROMPT ?= Once upon a time
PORT ?= 8080
# The default model writes English; tests and benchmarks use the random-weight
# qwen3 `small` model that CMake generates at build/models/default.gguf.
MODEL ?= models/stories260K.gguf

PREFIX ?= /usr/local

.PHONY: bench-attention all build build-asan build-tsan run generate test test-release test-asan test-tsan serve-soak bench bench-kv bench-serve bench-multiturn bench-scenarios bench-predict bench-retire-stall bench-spec bench-bw bench-remote load-test install docs fuzz-all clean

all: build

build:
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build -j $(JOBS)

build-asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBER_SANITIZE=ON >/dev/null
	cmake --build build-asan -j $(JOBS)

run: build
	@echo "ember: serving $(MODEL) on http://127.0.0.1:$(PORT) (Ctrl-C stops); live cache dashboard at http://127.0.0.1:$(PORT)/. Try (twice):"
	@echo "  curl -s http://127.0.0.1:$(PORT)/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\":\"Once upon a time, there was a little girl named Lily.\",\"max_tokens\":48,\"temperature\":0}'"
	./build/ember serve $(MODEL) --port $(PORT)

generate: build
	./build/ember run $(MODEL) -p "$(PROMPT)" -n 64

test-release: build
	cd build && ctest --output-on-failure -j $(JOBS)

test-asan: build-asan
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j $(JOBS)

# ThreadSanitizer over the multi-threaded parts: the server (its HTTP
# threads, scheduler and engine thread; the spawned `ember serve` is the TSan
# build too) and the cache tests that share one cache between threads. A
# report makes the process exit 66, which fails the test (the server's exit
# status is checked by test_serve). tests/tsan.supp silences libzmq, which is
# not instrumented (its lock-free pipes read as races).
TSAN_TESTS = test_serve test_apc test_ckpt test_engine test_apc_disk test_disk_async test_kv_events test_remote test_threadpool
TSAN_OPTIONS_ALL = halt_on_error=0 exitcode=66 second_deadlock_stack=1 history_size=4 suppressions=$(CURDIR)/tests/tsan.supp
build-tsan:
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEMBER_TSAN=ON >/dev/null
	cmake --build build-tsan -j $(JOBS) --target ember $(TSAN_TESTS)

test-tsan: build-tsan
	cd build-tsan && TSAN_OPTIONS="$(TSAN_OPTIONS_ALL)" ctest --output-on-failure -j $(JOBS) \
	  -R '^($(subst $(eval) ,|,$(TSAN_TESTS)))$$'

test: test-asan test-release test-tsan

# Soak of the server tests (not CI): test_serve SOAK_RUNS times, SOAK_COPIES
# side by side, with SOAK_BUSY busy loops loading the CPUs; prints the pass
# count. TEST_SERVE_FILTER='test_recurrent*' narrows it to some tests.
SOAK_RUNS ?= 50
SOAK_COPIES ?= 2
SOAK_BUSY ?= 1
serve-soak: build
	sh scripts/serve_soak.sh build $(SOAK_RUNS) $(SOAK_COPIES) $(SOAK_BUSY)

# Engine benchmark (issue 15): prefill and decode tokens/s of `ember mkmodel`
# shapes (random weights, generated here if missing), one bench_engine table
# per row of BENCH_ROWS (preset:type). With LLAMA_BENCH=/path/to/llama-bench
# (a llama.cpp build of your own, never committed) each table also carries
# llama.cpp's figure on the same file, measured in the same run, and the
# ratio ember / llama.cpp; a build that cannot load an architecture (the local
# one knows llama, not qwen3) prints "no ratio" for that table, so ratios
# exist for the llama-3.2-1b rows. Further tables:
#   long prefill (8k, 16k) on BENCH_LONG_ROW: slow (minutes per length);
#     f32 and bf16 attention alternating (docs/attention.md); BENCH_LONG=0
#     skips them, BENCH_LONG_PREFILL picks the lengths;
#   contention on BENCH_BUSY_ROW: a busy loop pinned to core BENCH_BUSY_CORE
#     while ember and llama.cpp run again, alternating quiet and loaded runs;
#     the fraction of speed each keeps, and their ratio (BENCH_BUSY_PREFILL,
#     BENCH_BUSY_DECODE size the runs).
# BENCH_IQ4_ROWS: the IQ4_NL / IQ4_XS rows (a llama.cpp that knows the
# i-quants gives ratios for the llama-3.2-1b ones).
# BENCH_AVX2_ROWS: ember on its AVX2 kernels (bench_engine --isa avx2), as a
# CPU without AVX-512 runs it; ember only (a llama-bench built for this CPU
# would run AVX-512). BENCH_AVX2=0 skips them.
BENCH_MODELS = build/bench-models
LLAMA_BENCH ?=
LLAMA_PERPLEXITY ?=
BENCH_ROWS ?= qwen3-0.6b:q8_0 qwen3-0.6b:q4_k qwen3-0.6b:f16 qwen3-0.6b:bf16 \
  llama-3.2-1b:q8_0 llama-3.2-1b:q4_k llama-3.2-1b:f16 llama-3.2-1b:bf16
BENCH_IQ4_ROWS ?= qwen3-0.6b:iq4_nl qwen3-0.6b:iq4_xs llama-3.2-1b:iq4_nl llama-3.2-1b:iq4_xs
BENCH_AVX2 ?= 1
BENCH_AVX2_ROWS ?= qwen3-0.6b:q8_0 qwen3-0.6b:q4_k qwen3-0.6b:f16 qwen3-0.6b:iq4_xs
BENCH_REPS ?= 3
BENCH_PREFILL ?= 512,2048
BENCH_DECODE ?= 128
BENCH_LONG ?= 1
BENCH_LONG_ROW ?= qwen3-0.6b:q8_0
BENCH_LONG_PREFILL ?= 512,8192,16384
BENCH_BUSY_ROW ?= llama-3.2-1b:q8_0
BENCH_BUSY_CORE ?= 1
BENCH_BUSY_ROUNDS ?= 3
BENCH_BUSY_PREFILL ?= 512
BENCH_BUSY_DECODE ?= 32
bench_model = $(BENCH_MODELS)/$(subst :,-,$(1)).gguf
bench: build
	mkdir -p $(BENCH_MODELS)
	for row in $(BENCH_ROWS) $(BENCH_IQ4_ROWS) $(if $(filter 1,$(BENCH_AVX2)),$(BENCH_AVX2_ROWS)) \
	    $(if $(filter 1,$(BENCH_LONG)),$(BENCH_LONG_ROW)) $(BENCH_BUSY_ROW); do \
	  f=$(BENCH_MODELS)/$$(echo $$row | tr : -).gguf; \
	  [ -f $$f ] || ./build/ember mkmodel --preset $${row%%:*} --type $${row##*:} --seed 1 --out $$f || exit 1; \
	done
	for row in $(BENCH_ROWS) $(BENCH_IQ4_ROWS); do \
	  ./build/bench_engine $(BENCH_MODELS)/$$(echo $$row | tr : -).gguf --label $$row --threads 2 --reps $(BENCH_REPS) \
	    --prefill $(BENCH_PREFILL) --decode $(BENCH_DECODE) --llama-bench "$(LLAMA_BENCH)" || exit 1; \
	done
	if [ "$(BENCH_AVX2)" = 1 ] && grep -qw avx2 /proc/cpuinfo; then \
	  for row in $(BENCH_AVX2_ROWS); do \
	    ./build/bench_engine $(BENCH_MODELS)/$$(echo $$row | tr : -).gguf --label "$$row avx2" --threads 2 --reps $(BENCH_REPS) \
	      --prefill $(BENCH_PREFILL) --decode $(BENCH_DECODE) --isa avx2 || exit 1; \
	  done; \
	fi
	if [ "$(BENCH_LONG)" = 1 ]; then \
	  ./build/bench_engine $(call bench_model,$(BENCH_LONG_ROW)) --label "$(BENCH_LONG_ROW) long prefill" --threads 2 --reps 1 \
	    --prefill $(BENCH_LONG_PREFILL) --decode 16 --attention both --llama-bench "$(LLAMA_BENCH)" || exit 1; \
	  ./build/bench_engine $(call bench_model,$(BENCH_LONG_ROW)) --label "$(BENCH_LONG_ROW) long prefill int8" --threads 2 \
	    --reps 1 --warmup 3 --prefill $(BENCH_LONG_PREFILL) --decode 16 --attention int8 || exit 1; \
	fi
	./build/bench_engine $(call bench_model,$(BENCH_BUSY_ROW)) --label "$(BENCH_BUSY_ROW) contention" --threads 2 --reps 1 \
	  --prefill $(BENCH_BUSY_PREFILL) --decode $(BENCH_BUSY_DECODE) --busy-core $(BENCH_BUSY_CORE) --rounds $(BENCH_BUSY_ROUNDS) --llama-bench "$(LLAMA_BENCH)"

# Attention alone (issue 15, docs/attention.md): one layer's last 512-row
# prefill chunk at 4k, 8k and 16k keys on the qwen3-0.6b head shape (f16
# rows, blocks scattered as in a served pool), f32, bf16 and int8, in GFLOP/s on
# one thread, with a digest of the output bits (equal for every --rows).
ATT_KEYS ?= 4096 8192 16384
bench-attention: build
	for k in $(ATT_KEYS); do ./build/bench_attention --keys $$k --reps 5 --rows 128 --precision all || exit 1; done

# KV formats (f32, f16, q8_0): quality against f32 KV (mean KL, top-1
# agreement, perplexity) over bench/data/kv_text.txt (English, 5092 stories260K
# tokens / 2301 qwen3 tokens), bytes per token and decode tokens/s at a 4096-token
# context, on the trained stories260K and on the qwen3-0.6b shape (random
# weights: its KL measures the numerical perturbation only). kvarn is measured
# by simulation (bench/bench_kv.c says how). docs/kv-formats.md.
KV_FORMATS ?= --formats f16,q8_0,kvarn-k6v5,kvarn-k6v5-t0,kvarn-k4v4-t0
# Beside llama.cpp's caches (LLAMA_PERPLEXITY=/path/llama-perplexity, a local
# build): the llama256 fixture (a llama both can run; stories260K's 8-wide
# heads are too narrow for llama.cpp's quantized caches), scored on the
# second half of each window as llama-perplexity scores.
KV_LLAMA_FORMATS ?= --formats q8_0,kvarn-k6v5,kvarn-k6v8,kvarn-k7v8-t0,kvarn-k4v4-t0
bench-kv: build
	./build/bench_kv ../shared/fixtures/reference/llama256-f32.gguf --text bench/data/kv_text.txt --threads 2 \
	  --second-halves 1 --decode-rounds 1 $(KV_LLAMA_FORMATS) --llama-perplexity "$(LLAMA_PERPLEXITY)" || exit 1
	mkdir -p $(BENCH_MODELS)
	./build/bench_kv models/stories260K.gguf --text bench/data/kv_text.txt --threads 2 $(KV_FORMATS) || exit 1
	[ -f $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf ] || ./build/ember mkmodel --arch qwen3 --preset qwen3-0.6b --type q8_0 --seed 1 --out $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf || exit 1
	./build/bench_kv $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf --text bench/data/kv_text.txt --threads 2 $(KV_FORMATS)

# Serving benchmark: ember serve on the built-in default model (qwen3 small,
# context 4096): aggregate decode tokens/s with 1, 4 and 16 streams, TTFT
# p50/p99 of a short request arriving while a 3584-token prompt prefills.
bench-serve: build
	./build/bench_serve --ember build/ember --model build/models/default.gguf --threads 2

# Multi-turn prompt-cache benchmark (issue 5): per turn of a chat, tokens
# re-prefilled and TTFT with the cache on vs off, on the `small` model of each
# family (generated here if missing). TURNS/TURN_TOKENS size the chat;
# MT_ARGS adds options (e.g. --reply 64), MT_FAMILIES picks the families.
TURNS ?= 10
TURN_TOKENS ?= 1024
MT_FAMILIES ?= qwen3 gemma3 qwen35 mamba2 falcon-h1
bench-multiturn: build
	mkdir -p $(BENCH_MODELS)
	for a in $(MT_FAMILIES); do \
	  f=$(BENCH_MODELS)/$$a-small-q8_0.gguf; \
	  [ -f $$f ] || ./build/ember mkmodel --arch $$a --preset small --type q8_0 --seed 1 --out $$f || exit 1; \
	  ./build/bench_multiturn --model $$f --turns $(TURNS) --turn-tokens $(TURN_TOKENS) --threads 2 $(MT_ARGS) || exit 1; \
	done

# Reuse scenarios (issue 17): identical resend, 6-turn chat, 4 agents x 2 turns
# on a 1,500-token system prompt, branch A+B then A+C, restart from the SSD
# tier; per family (`small` models, generated here if missing), prompt tokens
# computed beside the ideal, and what the snapshot stops cost in prefill time.
# SC_ARGS adds options: --interval T (snapshot spacing; 0: the old ckpt/exact
# tiers), --llama-url http://127.0.0.1:PORT (the same requests against a
# llama-server started on the same model file, side by side).
SC_ARGS ?=
bench-scenarios: build
	mkdir -p $(BENCH_MODELS)
	for a in $(MT_FAMILIES); do \
	  f=$(BENCH_MODELS)/$$a-small-q8_0.gguf; \
	  [ -f $$f ] || ./build/ember mkmodel --arch $$a --preset small --type q8_0 --seed 1 --out $$f || exit 1; \
	done
	./build/bench_scenarios --threads 2 $(SC_ARGS) $(foreach a,$(MT_FAMILIES),--model $(BENCH_MODELS)/$(a)-small-q8_0.gguf)

# The cost of one next-turn render prediction (the engine-thread stall each
# one caused before predictions moved to the predictor thread): an ~8k-token
# conversation, the model's template, a GPT-2-sized BPE vocabulary.
bench-predict: build
	mkdir -p $(BENCH_MODELS)
	[ -f $(BENCH_MODELS)/qwen3-tiny-gpt2.gguf ] || ./build/ember mkmodel --arch qwen3 --preset tiny --seed 1 \
	  --vocab ../shared/fixtures/models/vocab/ggml-vocab-gpt-2.gguf --out $(BENCH_MODELS)/qwen3-tiny-gpt2.gguf
	./build/bench_predict $(BENCH_MODELS)/qwen3-tiny-gpt2.gguf --tokens 8192 --reps 20

# Decode gaps of 16 streams while long chat conversations retire on a ckpt-tier
# model with a GPT-2-sized vocabulary (render predictions off the engine thread).
bench-retire-stall: build
	mkdir -p $(BENCH_MODELS)
	[ -f $(BENCH_MODELS)/qwen35-small-gpt2.gguf ] || ./build/ember mkmodel --arch qwen35 --preset small --type q8_0 \
	  --seed 1 --vocab ../shared/fixtures/models/vocab/ggml-vocab-gpt-2.gguf --out $(BENCH_MODELS)/qwen35-small-gpt2.gguf
	./build/ember serve $(BENCH_MODELS)/qwen35-small-gpt2.gguf --port 18081 --ctx 16384 --threads 2 2>/dev/null & \
	  pid=$$!; sleep 3; python3 bench/bench_retire_stall.py 18081 30; rc=$$?; kill $$pid; exit $$rc

# Speculative decoding (issue 11): the cost of verifying k drafts in one
# forward on the qwen3-0.6b shape (Q8_0), then decode speed plain vs fixed k
# vs adaptive k (the cost governor), interleaved per prompt over rounds, on
# stories260K drafted by its own Q8_0 and Q4_0 copies, by itself, by prompt
# lookup, and at low acceptance by random-weight models with its vocabulary
# (a llama and a recurrent mamba2, `ember mkmodel --vocab`) and by lookup on
# text that does not repeat; then the qwen35 MTP head (a random fixture:
# acceptance near 0). Each drafter runs on one engine per mode for the whole
# run (a server's view: the governor learns once), with a fresh engine's
# first request apart. Then `warm`: per decoded position, the acceptance of
# a cold request and of the same prompt warm with and without the drafter's
# sidecar, with the times and the draft model's rows (stories260K drafted by
# its Q8_0 copy, and the qwen35 MTP head). docs/speculative-cache.md keeps
# the figures.
SPEC_NOREPEAT = --prompt "Tim found a blue kite under an old bench." --prompt "A small frog jumped over seven wet stones." \
  --prompt "Grandpa baked bread while snow covered every roof outside."
bench-spec: build
	mkdir -p $(BENCH_MODELS)
	[ -f $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf ] || ./build/ember mkmodel --arch qwen3 --preset qwen3-0.6b --type q8_0 \
	  --seed 1 --out $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf
	./build/bench_spec verify $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf --ctx 512
	for t in q8_0 q4_0; do [ -f $(BENCH_MODELS)/stories260K-$$t.gguf ] || \
	  ./build/ember quantize models/stories260K.gguf $(BENCH_MODELS)/stories260K-$$t.gguf --type $$t || exit 1; done
	for a in llama mamba2; do [ -f $(BENCH_MODELS)/random-$$a-stories-vocab.gguf ] || ./build/ember mkmodel --arch $$a \
	  --vocab models/stories260K.gguf --seed 7 --out $(BENCH_MODELS)/random-$$a-stories-vocab.gguf || exit 1; done
	cat /proc/loadavg
	./build/bench_spec decode models/stories260K.gguf --draft $(BENCH_MODELS)/stories260K-q8_0.gguf \
	  --draft $(BENCH_MODELS)/stories260K-q4_0.gguf --draft $(BENCH_MODELS)/random-llama-stories-vocab.gguf \
	  --draft $(BENCH_MODELS)/random-mamba2-stories-vocab.gguf --self --lookup --tokens 256 --rounds 11 2>/dev/null
	./build/bench_spec decode models/stories260K.gguf --lookup $(SPEC_NOREPEAT) --tokens 256 --rounds 11 2>/dev/null
	./build/bench_spec decode ../shared/fixtures/reference/qwen35-mtp-normjit-f32.gguf --mtp --lookup --tokens 512 \
	  --rounds 7 2>/dev/null
	./build/bench_spec warm models/stories260K.gguf --draft $(BENCH_MODELS)/stories260K-q8_0.gguf --prompt-len 512 \
	  --tokens 128 2>/dev/null
	./build/bench_spec warm ../shared/fixtures/reference/qwen35-mtp-normjit-f32.gguf --mtp --prompt-len 512 --tokens 128 \
	  2>/dev/null

# Decode against the memory bandwidth (issue 15): a STREAM-like triad and a
# read pass on this machine, then decode at position 512 on the qwen3-0.6b
# shape in Q8_0, Q4_K and F16, as bytes/s and as a fraction of both at the
# same thread count, with where each step's time goes (bench/bench_bw.c);
# then attention per token at 4k positions per KV format and ISA.
# BW_THREADS=2 for one thread count; BW_KV=f16 for the server's default KV
# format (default f32).
BW_THREADS ?= 1,2
BW_KV ?= f32
bench-bw: build
	mkdir -p $(BENCH_MODELS)
	for t in q8_0 q4_k f16; do \
	  [ -f $(BENCH_MODELS)/qwen3-0.6b-$$t.gguf ] || ./build/ember mkmodel --arch qwen3 --preset qwen3-0.6b --type $$t \
	    --seed 1 --out $(BENCH_MODELS)/qwen3-0.6b-$$t.gguf || exit 1; done
	./build/bench_bw --threads $(BW_THREADS) --reps 20 --kv $(BW_KV) --profile $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf \
	  $(BENCH_MODELS)/qwen3-0.6b-q4_k.gguf $(BENCH_MODELS)/qwen3-0.6b-f16.gguf
	./build/bench_bw --attention 4096 --reps 5

# The remote tier (issue 13): TTFT of a replica that takes another
# replica's KV from Redis vs a cold prefill, at REMOTE_SIZES tokens on the
# qwen3-0.6b shape (Q8_0 weights; the KV is f32), and the hit rate of two
# replicas sharing Redis on a replayed multi-user trace (the `small` qwen3
# model) vs one replica. The bench starts its own redis-server.
REMOTE_SIZES ?= 4096,16384
bench-remote: build
	mkdir -p $(BENCH_MODELS)
	[ -f $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf ] || ./build/ember mkmodel --arch qwen3 --preset qwen3-0.6b --type q8_0 \
	  --seed 1 --out $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf
	./build/bench_remote $(BENCH_MODELS)/qwen3-0.6b-q8_0.gguf --threads 2 --sizes $(REMOTE_SIZES) \
	  --trace-model build/models/default.gguf

# Load test (not CI): 32 concurrent streaming clients for 60 s against ember
# serve on loopback; fails on any failed or malformed response, or when the
# server's RSS after the run is not within 10% of before.
load-test: build
	./build/bench_load --ember build/ember --model build/models/default.gguf --clients 32 --seconds 60

# Installs bin/ember and share/man/man1/ember.1 under PREFIX.
install: build
	cmake --install build --prefix $(PREFIX)

# Regenerates docs/cache-switches.md from the settings table (test_settings
# fails while the committed file differs).
docs: build
	./build/ember settings --markdown --out docs/cache-switches.md

# libFuzzer (clang): every parser of outside input -- GGUF reader, tokenizers,
# Jinja templates, the chat/completions request parser, the YAML config --
# fuzzed for FUZZ_SECONDS each in build-fuzz/ (ASan+UBSan). Seeds and crash
# reproducers live in tests/fuzz/<target>/ (CTest replays them in every
# build); new corpus entries stay in build-fuzz/corpus/<target>. Fails on the
# first crash, leak, timeout (FUZZ_TIMEOUT s per input) or out-of-memory,
# leaving its reproducer as tests/fuzz/<target>/crash-*.
FUZZ_SECONDS ?= 600
FUZZ_TIMEOUT ?= 10
FUZZ_TARGETS ?= gguf tokenizer jinja api config
fuzz-all:
	cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DEMBER_FUZZ=ON >/dev/null
	cmake --build build-fuzz -j $(JOBS) --target fuzz default_model
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t; \
	  echo "fuzz-all: fuzz_$$t for $(FUZZ_SECONDS) s"; \
	  EMBER_FUZZ_MODEL=build-fuzz/models/default.gguf ./build-fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) \
	    -timeout=$(FUZZ_TIMEOUT) -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix=tests/fuzz/$$t/ \
	    build-fuzz/corpus/$$t tests/fuzz/$$t/corpus || exit 1; \
	done

clean:
	rm -rf build build-asan build-fuzz build-tsan
