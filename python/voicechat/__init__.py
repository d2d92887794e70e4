"""voicechat: NemotronLabs VoiceChat on MLX, with a C++ core.

    import voicechat
    chat = voicechat.load("mlx-community/NemotronLabs-VoiceChat-11B-4bit")
    result = chat.generate("question.wav")
"""

__version__ = "0.1.0"
