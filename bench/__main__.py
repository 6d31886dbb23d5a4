"""Run every benchmark: `python -m bench` (what `make bench` calls)."""

from bench import sync

if __name__ == "__main__":
    sync.main()
