"""The mesh sweep: the sweep's models on a 2 x 2 mesh of processes under torch's pipeline
schedules with DDP or FSDP, each (model, configuration) checked against eager."""
