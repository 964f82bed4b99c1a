"""moechat terminal app and CLI. Never imports torch at start-up."""
