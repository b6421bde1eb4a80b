"""Price: what every node of a traced graph costs (roofline, profiled time, FLOPs or
parameter bytes) and the bytes of every value."""
