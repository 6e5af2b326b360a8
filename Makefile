# ott-gguf: the two commands of the README are `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
PIP     := $(VENV)/bin/pip
BIN     := $(VENV)/bin
LCP     := llama-cpp-python==0.3.36
# the dependencies of llama-cpp-python's [server] extra (its own OpenAI-compatible server, tested as a drop-in;
# PyYAML is in the test line), named here so that pip never touches the llama-cpp-python installed above
LCP_SERVER := "uvicorn>=0.22.0" "fastapi>=0.100.0" "pydantic-settings>=2.0.1" "sse-starlette>=1.6.1" \
              "starlette-context>=0.3.6,<0.4"
# libvulkan-dev, glslc, spirv-headers: the Vulkan backend (OTT_GGUF_VULKAN=AUTO builds it when they are present);
# mesa-vulkan-drivers: lavapipe, Mesa's Vulkan on the CPU, that the Vulkan tests run on without a GPU;
# chromium: the chat page's test drives it headless (tests/test_web.py)
APT_BUILD := g++ cmake ninja-build patch python3-venv libvulkan-dev glslc spirv-headers ccache
APT_TEST  := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user mesa-vulkan-drivers chromium
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_PROGRESS_BAR=off

.PHONY: install demo test test-all gpu-test cuda-bench models lint apt-build apt-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Debian packages: compilers and the Vulkan SDK parts for the build; an aarch64 cross compiler and qemu-user for
# the NEON tests, lavapipe for the Vulkan tests
define apt_ensure
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
endef
apt-build:
	$(call apt_ensure,$(APT_BUILD))
apt-test:
	$(call apt_ensure,$(APT_TEST))

# The CMake build directory lives outside the clone, one per clone path (a hash of it), so that a fresh clone at
# the same path (CI's) rebuilds only what changed: an ordinary incremental build (the patched llama.cpp tree and the
# generated files are rewritten only when their content changes, gen/generate.py removes the files it no longer
# generates), where a build inside the clone regenerated ggml-vulkan's shaders every time (minutes; ccache does not
# cache them). OTT_BUILD_DIR=build keeps it in the tree; `make clean` removes it.
OTT_CACHE_DIR ?= $(or $(OTT_GGUF_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ott-gguf)
OTT_BUILD_DIR ?= $(OTT_CACHE_DIR)/build/$(shell printf %s "$(CURDIR)" | sha256sum | cut -c1-16)

# llama-cpp-python is installed as the Python layer only (LLAMA_BUILD=OFF): llama.cpp is compiled once,
# patched, by this project's CMakeLists.txt, and installed into ott_gguf/lib and ott_gguf/bin.
install: apt-build $(BIN)/python
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PIP) install -q "$(LCP)"
	$(PIP) install -q "scikit-build-core>=0.10" "jinja2>=3.1"
	@echo "building the patched llama.cpp (the first time 6-20 minutes on 2 cores; then incremental)"
	@echo "build directory: $(OTT_BUILD_DIR)"
	$(PIP) install -q --no-build-isolation -Cbuild-dir="$(OTT_BUILD_DIR)/{wheel_tag}" $(PIP_INSTALL_ARGS) .

models: install
	$(BIN)/ott-gguf models

demo: install
	$(BIN)/ott-gguf generate --kv-type ott2 "Explain in two sentences why the sky is blue."

lint: $(BIN)/python
	$(PIP) install -q "ruff>=0.6"
	$(BIN)/ruff check ott_gguf study tests gen models native
	$(BIN)/ruff format --check ott_gguf study tests gen models native

# the test files run in TEST_WORKERS processes (pytest-xdist, a file per process at a time: a module's model is
# loaded once); 1 runs them in this one. Two on 2 cores: much of the suite leaves a core idle (nvcc, lavapipe's one
# thread, numpy), and the tests' OpenMP threads sleep soon at their barriers (GOMP_SPINCOUNT, tests/conftest.py):
# measured 416 s -> 319 s on a dozen files (docs/testing.md). The longest files first (tests/conftest.py COST_ORDER),
# not xdist's default of the files with the most tests first
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,)

test: install apt-test lint
	$(PIP) install -q "pytest>=8" "hypothesis>=6.100" "matplotlib>=3.7" "pexpect>=4.9" "pyyaml>=6" "cffi>=1.16" \
	  $(LCP_SERVER) "openai>=1.0" "gguf>=0.17" "pytest-xdist>=3.5"
	$(BIN)/ott-gguf models
	@echo "make test: installed and linted; pytest starts at $$(date +%T)"
	cd tests && ../$(BIN)/pytest -q -p no:cacheprovider --durations=10 $(XDIST) $(PYTEST_ARGS)

# every case of the test matrix (docs/testing.md): `make test` runs one case per kind, rotating with the commit
test-all:
	OTT_TEST_ALL=1 $(MAKE) test

# on a machine with an NVIDIA GPU and the CUDA toolkit: build with CUDA, run the GPU tests and the GPU benchmark
gpu-test: apt-build $(BIN)/python
	$(MAKE) install PIP_INSTALL_ARGS='-Ccmake.define.OTT_GGUF_CUDA=ON'
	$(PIP) install -q "pytest>=8" "hypothesis>=6.100" "cffi>=1.16"
	$(BIN)/ott-gguf models
	$(BIN)/python -m study.gpu_check --out docs/benchmarks-gpu.md

# the ott2 CUDA ops timed alone (docs/cuda-harness.md): build/cuda-bench/ott-bench, built without a GPU (nvcc and
# jinja2), run on one
cuda-bench:
	bash native/tests/build-ott-bench.sh build/cuda-bench

clean:
	rm -rf build $(VENV) "$(OTT_BUILD_DIR)"
