"""`python -m ops.devstack`: what `make dev` runs."""

from ops.devstack.runner import main

if __name__ == "__main__":
    main()
