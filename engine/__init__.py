"""moechat engine: loading, models, expert providers, generation. Never imports Textual."""
