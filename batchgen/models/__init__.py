"""Our own model implementations on the paged KV cache, and the weight loader."""
