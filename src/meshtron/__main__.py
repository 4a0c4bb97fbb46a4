"""`python -m meshtron ...`: the `meshtron` command (what torch's launcher runs on every rank)."""

from meshtron.commands.main import entry

if __name__ == "__main__":
    entry()
