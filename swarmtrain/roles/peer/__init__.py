"""Peer mode: no coordinator; peers discover each other, agree a membership per epoch, and
average gradients or weights around a ring."""
