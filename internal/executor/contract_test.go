package executor_test

import (
	"testing"

	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/executor/executortest"
)

// The executor's fakes keep the contracts the executor relies on; the
// store's and the shard manager's packages run the same contracts against
// the real parts.

func TestFakeStoreKeepsTheStoreContract(t *testing.T) {
	t.Parallel()
	executortest.StoreContract(t, func(t *testing.T) executortest.StoreHarness { return executor.NewFakeStoreHarness(t) })
}

func TestFakeOwnershipKeepsTheOwnershipContract(t *testing.T) {
	t.Parallel()
	executortest.OwnershipContract(t, func(t *testing.T) executortest.OwnershipHarness {
		return executor.NewFakeOwnershipHarness(t)
	})
}
