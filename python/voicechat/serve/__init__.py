"""`vc-serve`: VoiceChat over an OpenAI-Realtime-compatible WebSocket (the `serve` extra)."""
