"""The coordinator wire contract. Pure: no sockets, no MLX."""
