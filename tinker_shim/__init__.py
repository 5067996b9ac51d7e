"""The Tinker wire protocol (SDK 0.38): routes, protobuf/JSON codecs, ids, error mapping."""
