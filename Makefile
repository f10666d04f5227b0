# shardrun developer entry points. `make demo` and `make test` are the two
# commands a new user needs; the rest are for working on shardrun. Each
# target first runs scripts/deps.sh, which installs the Debian packages it
# needs (or says which command would), before anything is compiled.
GO        ?= go
BIN       := bin
DEPS      := scripts/deps.sh
BUILD      = $(GO) build -o $(BIN)/ ./cmd/...
# The staticcheck scripts/deps.sh installs (pinned), not whichever is on PATH.
STATICCHECK ?= $(shell gobin=$$($(GO) env GOBIN); echo $${gobin:-$$($(GO) env GOPATH)/bin})/staticcheck

.PHONY: all build test upgrade-test fuzz lint demo bench model model-bounds deploy-test clean

all: build

## build: the runner and coordinator binaries, into bin/
build:
	@$(DEPS) build
	$(BUILD)

## test: the whole suite with the race detector (starts its own PostgreSQL and etcd)
## TEST_P test binaries run at a time, at least 4 where go test would run one per core: the
## suite mostly waits on leases, timeouts and processes (on 2 cores, one binary per core
## took 325 s for 195 s of CPU). The integration tests, the longest package, are named first
## so that they start first. The race-instrumented packages are compiled before any test
## runs: from an empty build cache, tests that bound a time from above failed when they
## shared 2 cores with four compilers.
TEST_P ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n > 4 ? n : 4 )))
test:
	@$(DEPS) test
	$(GO) vet ./...
	$(GO) build -race $$($(GO) list -f '{{if and .GoFiles (ne .Name "main")}}{{.ImportPath}}{{end}}' ./...)
	$(GO) test -race -p $(TEST_P) -timeout 20m ./integration ./...

## upgrade-test: the upgrade to the task layout at a million tasks (make test runs it at 200,000)
UPGRADE_ROWS ?= 1000000
upgrade-test:
	@$(DEPS) test
	SHARDRUN_UPGRADE_ROWS=$(UPGRADE_ROWS) $(GO) test -count=1 -timeout 20m -run '^TestUpgradeToTheTaskLayout$$' -v ./store/

## fuzz: every decoder of outside input (bodies, query strings, flags), briefly (FUZZTIME each; go test -fuzz takes one
## package and one target per run). The committed seeds in testdata/fuzz/ also run in `make test`.
FUZZTIME ?= 5s
FUZZ_TARGETS := \
	./internal/jsonbody:FuzzDecode \
	./internal/coordinator:FuzzEnqueueOne \
	./internal/coordinator:FuzzEnqueueBatch \
	./internal/coordinator:FuzzFilterQuery \
	./internal/coordinator:FuzzListingQuery \
	./internal/runner:FuzzAdminBody \
	./internal/runner:FuzzBuiltinPayload \
	./cmd/runner:FuzzRunnerFlags \
	./cmd/coordinator:FuzzCoordinatorFlags
fuzz:
	@$(DEPS) fuzz
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; fn=$${t##*:}; \
		echo "fuzz: $$fn in $$pkg for $(FUZZTIME)"; \
		$(GO) test -run "^$$fn$$" -fuzz "^$$fn$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 100x $$pkg; \
	done

## lint: formatting, vet and staticcheck
lint:
	@$(DEPS) lint
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(STATICCHECK) ./...
	$(GO) vet -tags deploy ./deploy/
	$(STATICCHECK) -tags deploy ./deploy/
	cd bench && $(GO) vet ./... && $(STATICCHECK) ./...

## demo: an all-in-one cluster (embedded etcd, throwaway PostgreSQL, coordinator, 3 runners); Ctrl-C stops it
## (DATABASES=2 runs it on two databases of the throwaway PostgreSQL, the shards split between them;
## DEMO_FLAGS passes coordinator flags, e.g. DEMO_FLAGS="--http-addr 127.0.0.1:9000 --dev-rate 200")
DATABASES ?= 1
demo:
	@$(DEPS) demo
	$(BUILD)
	$(BIN)/coordinator --dev --dev-databases $(DATABASES) $(DEMO_FLAGS)

## bench: side-by-side benchmarks; writes bench/results/latest.json
## (BENCH_FLAGS passes the harness's flags, e.g. BENCH_FLAGS="-only throughput,steady")
bench:
	@$(DEPS) bench
	$(BUILD)
	$(GO) build -o $(BIN)/ ./internal/cmd/txworker
	cd bench && $(GO) run . -out results/latest.json -runner $(abspath $(BIN))/runner -txworker $(abspath $(BIN))/txworker $(BENCH_FLAGS)

## model: model-check the ownership protocol (capability groups included) and the sequence protocol with spin
model:
	@$(DEPS) model
	$(MAKE) -C model check

## model-bounds: the model at the edges of its safety bound (slower)
model-bounds:
	@$(DEPS) model-bounds
	$(MAKE) -C model bounds

## deploy-test: build the images docker-compose.yml needs (local stand-ins where no registry
## is reachable) and run the deployment through its faults on the Docker engine
## (-race as in make test, so the test binary's packages come from the same build cache)
deploy-test:
	@$(DEPS) deploy-test
	deploy/standins/build.sh
	$(GO) test -race -tags deploy -count=1 -timeout 40m -v ./deploy/

clean:
	rm -rf $(BIN)
