"""Stands in for torch.nn: a Module with a __dict__ on top of object, as nn.Module has."""


class Module:
    def __init__(self) -> None:
        self.training = True
