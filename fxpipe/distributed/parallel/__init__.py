"""State across ranks: the device mesh's groups and data parallelism over them (``mesh``),
the whole of a DTensor and one rank's part (``dtensors``), and which of the model's tensors
a rank keeps (``ownership``)."""
