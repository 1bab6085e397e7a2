"""The plain path's replica function: module-level, so xmp.spawn can pickle it by name."""


def printer(index, n):
    for i in range(n):
        print(f"r{index} line {i}")
