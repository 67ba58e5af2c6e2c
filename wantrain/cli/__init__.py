"""wantrain.cli"""
