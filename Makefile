# Thin wrapper over CMake. `make run` builds and runs ember on its built-in
# default model; `make test` builds twice (optimized, and with ASan+UBSan)
# and runs every test in both builds.
JOBS ?= $(shell nproc)
PROMPT ?= Once upon a time

.PHONY: all build build-asan run test test-release test-asan bench clean

all: build

build:
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build -j $(JOBS)

build-asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBER_SANITIZE=ON >/dev/null
	cmake --build build-asan -j $(JOBS)

run: build
	./build/ember run build/models/default.gguf -p "$(PROMPT)" -n 64

test-release: build
	cd build && ctest --output-on-failure -j $(JOBS)

test-asan: build-asan
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j $(JOBS)

test: test-asan test-release

bench: build
	./build/bench_engine

clean:
	rm -rf build build-asan
