def main(argv=None):
    raise SystemExit("CLI under construction")
