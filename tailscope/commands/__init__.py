"""The ``tailscope`` commands, one module each (``tailscope.cli`` builds the parser from
them): ``add_parser(sub)`` declares a command's arguments, its ``cmd_*`` function runs it."""
