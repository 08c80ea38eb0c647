"""The kinds of ranks a run starts (Horovod's, torch.distributed's): their rendezvous, rank plan and environment."""
