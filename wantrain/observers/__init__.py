"""wantrain.observers"""
