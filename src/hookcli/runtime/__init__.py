"""The process around a run: the supervised worker, its beacon, standard streams, the CPU ISA."""
