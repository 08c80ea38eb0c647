"""sparkdl's ``sparkdl.horovod.tensorflow`` path."""
