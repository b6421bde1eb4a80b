"""The mesh sweep: the sweep's models on meshes of processes (pipeline alone, x data, x
tensor parallel) under torch's pipeline schedules, each (model, configuration, dtype)
checked against eager."""
