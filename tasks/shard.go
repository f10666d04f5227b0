package tasks

// ShardOf maps a task key to its shard: the 64-bit FNV-1a hash of the key's
// UTF-8 bytes, modulo the shard count. It is part of the public contract so
// that producers in other languages can compute the same shard:
//
//	h := 14695981039346656037
//	for each byte b of key: h = (h XOR b) * 1099511628211   (mod 2^64)
//	shard = h mod shardCount
//
// shardCount must be at least 1.
func ShardOf(key string, shardCount int) int {
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	for i := 0; i < len(key); i++ {
		h ^= uint64(key[i])
		h *= prime
	}
	return int(h % uint64(shardCount))
}
