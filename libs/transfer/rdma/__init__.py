"""RDMA data plane through pyverbs (an optional extra, imported lazily): wire codec, memory regions, verbs, transport."""
