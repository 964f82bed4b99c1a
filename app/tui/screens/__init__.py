"""Screens of the terminal app: chat, welcome, saved chats, dialogs."""
