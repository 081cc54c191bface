"""What a training checkpoint holds and how it is written and read: the file format (atomic files and sharded
directories, states by name, safe loading), a run's RNG states and parallelism, and where the training data
resumes."""
