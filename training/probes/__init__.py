"""The probes that decide which model ships (training/passes.py's gate): do the layers tell WordNet's senses apart
(`senses`), and which layer carries the part of speech (`syntax`). They embed through the service's engine on an
exported model; `python -m training.probes.senses` and `python -m training.probes.syntax` print their tables."""
