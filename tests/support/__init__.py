"""What the tests share: helpers, fixtures' builders, real servers on 127.0.0.1."""
