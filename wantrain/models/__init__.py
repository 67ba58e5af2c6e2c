"""wantrain.models"""
