"""Devices: the ones stages run on (parsed, compared, their memory), the memory budgets and
relative speeds users give per device, and speeds measured per kind of device."""
