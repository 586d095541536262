"""Stage 4, training: ``trainer`` (the torchft loop a replica group runs), ``replica`` (its process
entrypoint), ``plan`` (the files the groups and the supervisor share), ``supervisor`` (the stage's
orchestrating side) and ``flops`` (exact FLOP counts)."""
